"""Average the weights of saved heads of one layout (a uniform "model soup", Wortsman et al. 2022):

    python scripts/average_heads.py OUT_DIR HEAD HEAD [...]   # head or training-run directories

OUT_DIR gets the first head's config.json and the mean of every floating-point tensor; integer
tensors (the draft-vocabulary maps) must be equal in every head and are copied. Score the average
as any saved head, with a zero-step run (``train.init_head=OUT_DIR train.epochs=null
train.max_steps=0``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from draftheads.export.checkpoint import save_tensors
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError, read_weights, resolve_head_dir


def average(heads: list[Path]) -> dict[str, torch.Tensor]:
    states = [read_weights(head / WEIGHTS_NAME) for head in heads]
    first_head, first_state = heads[0], states[0]
    for head, state in zip(heads[1:], states[1:]):
        if state.keys() != first_state.keys():
            raise SystemExit(
                f"{head / WEIGHTS_NAME}: tensors {sorted(state.keys() ^ first_state.keys())} "
                f"differ from {first_head}'s"
            )
        for name, first in first_state.items():
            if state[name].shape != first.shape:
                raise SystemExit(
                    f"{head / WEIGHTS_NAME}: '{name}' has shape {tuple(state[name].shape)}, "
                    f"{first_head}'s {tuple(first.shape)}; only heads of one layout average"
                )
            if not first.is_floating_point() and not torch.equal(state[name], first):
                raise SystemExit(
                    f"{head / WEIGHTS_NAME}: '{name}' differs from {first_head}'s; "
                    "only heads of one layout average"
                )
    return {
        name: sum(state[name].float() for state in states).div(len(states)).to(first.dtype)
        if first.is_floating_point()
        else first  # index tables, equal in every head
        for name, first in first_state.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("heads", type=Path, nargs="+")
    args = parser.parse_args()
    if len(args.heads) < 2:
        parser.error("give two or more heads")
    try:
        heads = [resolve_head_dir(head) for head in args.heads]
        mean = average(heads)
    except HeadFormatError as error:
        raise SystemExit(f"error: {error}") from None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(heads[0] / CONFIG_NAME, args.out_dir / CONFIG_NAME)
    save_tensors(mean, args.out_dir / WEIGHTS_NAME)
    print(f"wrote {args.out_dir / WEIGHTS_NAME}: the mean of {len(heads)} heads")


if __name__ == "__main__":
    main()
