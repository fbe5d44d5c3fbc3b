"""Average the weights of saved heads of one layout (a uniform "model soup", Wortsman et al. 2022):

    python docs/results/training/average.py OUT_DIR HEAD_DIR HEAD_DIR [...]

OUT_DIR gets the first head's config.json and the mean of every floating-point tensor; integer
tensors (the draft-vocabulary maps) must be equal in every head and are copied. Score the average
as any saved head, with a zero-step run (``train.init_head=OUT_DIR train.epochs=null
train.max_steps=0``).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def average(heads: list[Path]) -> dict:
    states = [load_file(head / WEIGHTS) for head in heads]
    for head, state in zip(heads[1:], states[1:]):
        if state.keys() != states[0].keys():
            raise SystemExit(
                f"{head / WEIGHTS}: tensors {sorted(state.keys() ^ states[0].keys())} differ from {heads[0]}"
            )
    mean = {}
    for name, first in states[0].items():
        for head, state in zip(heads[1:], states[1:]):
            if state[name].shape != first.shape:
                raise SystemExit(
                    f"{head / WEIGHTS}: '{name}' has shape {tuple(state[name].shape)}, "
                    f"{heads[0]}'s {tuple(first.shape)}; only heads of one layout average"
                )
        if first.is_floating_point():
            mean[name] = sum(state[name].float() for state in states).div(len(states)).to(first.dtype)
            continue
        for head, state in zip(heads[1:], states[1:]):
            if not (state[name] == first).all():
                raise SystemExit(
                    f"{head / WEIGHTS}: '{name}' differs from {heads[0]}'s; only heads of one layout average"
                )
        mean[name] = first
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("heads", type=Path, nargs="+")
    args = parser.parse_args()
    if len(args.heads) < 2:
        parser.error("give two or more heads")
    mean = average(args.heads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(args.heads[0] / "config.json", args.out_dir / "config.json")
    save_file(mean, str(args.out_dir / WEIGHTS), metadata={"format": "pt"})
    print(f"wrote {args.out_dir / WEIGHTS}: the mean of {len(args.heads)} heads")


if __name__ == "__main__":
    main()
