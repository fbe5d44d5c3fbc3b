"""Restrict a grown EAGLE-3 head to a smaller head's draft vocabulary, to score what the added ids
bring once trained:

    python scripts/restrict_vocab.py OUT_DIR GROWN SMALLER   # head or training-run directories

OUT_DIR gets SMALLER's config.json and draft-vocabulary maps (d2t, t2d), GROWN's lm_head rows of
those ids, and GROWN's other tensors (which must have SMALLER's shapes). Every id of SMALLER's
vocabulary must be in GROWN's, as ``train.init_head`` growth keeps them. Score the result as any
saved head, with a zero-step run (``train.init_head=OUT_DIR train.max_steps=0``, with SMALLER's
``head.draft_vocab_size``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from draftheads.export.checkpoint import save_tensors
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError, read_weights, resolve_head_dir

VOCABULARY = ("lm_head.weight", "d2t", "t2d")


def target_ids(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) the base-vocabulary id of each draft id: d + d2t[d]."""
    return torch.arange(state["d2t"].shape[0]) + state["d2t"]


def restrict(grown: dict[str, torch.Tensor], smaller: dict[str, torch.Tensor], where: str) -> dict:
    ids, kept = target_ids(grown), target_ids(smaller)
    position = {int(token): row for row, token in enumerate(ids.tolist())}
    missing = [int(token) for token in kept.tolist() if int(token) not in position]
    if missing:
        raise SystemExit(
            f"{where}: {len(missing)} ids of the smaller vocabulary are not in it (first: {missing[:5]})"
        )
    state = {}
    for name, tensor in grown.items():
        if name in VOCABULARY:
            continue
        if name not in smaller or smaller[name].shape != tensor.shape:
            found = tuple(smaller[name].shape) if name in smaller else "nothing"
            raise SystemExit(f"{where}: '{name}' has shape {tuple(tensor.shape)}, the smaller head {found}")
        state[name] = tensor
    state["lm_head.weight"] = grown["lm_head.weight"][torch.tensor([position[int(t)] for t in kept.tolist()])]
    state["d2t"], state["t2d"] = smaller["d2t"], smaller["t2d"]
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("grown", type=Path)
    parser.add_argument("smaller", type=Path)
    args = parser.parse_args()
    try:
        grown_dir, smaller_dir = resolve_head_dir(args.grown), resolve_head_dir(args.smaller)
        grown, smaller = read_weights(grown_dir / WEIGHTS_NAME), read_weights(smaller_dir / WEIGHTS_NAME)
    except HeadFormatError as error:
        raise SystemExit(f"error: {error}") from None
    for name in VOCABULARY:
        for directory, state in ((grown_dir, grown), (smaller_dir, smaller)):
            if name not in state:
                raise SystemExit(f"{directory / WEIGHTS_NAME}: no '{name}': not an EAGLE-3 head")
    state = restrict(grown, smaller, str(grown_dir / WEIGHTS_NAME))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(smaller_dir / CONFIG_NAME, args.out_dir / CONFIG_NAME)
    save_tensors(state, args.out_dir / WEIGHTS_NAME)
    print(
        f"wrote {args.out_dir / WEIGHTS_NAME}: {grown_dir}'s weights on "
        f"{smaller_dir}'s {len(state['d2t'])} draft ids"
    )


if __name__ == "__main__":
    main()
