"""``draftheads train --config FILE [key=value ...]``: train a draft head on a base model.

Runs as a single process on a CPU, or under the DeepSpeed launcher on GPUs:
``deepspeed --num_gpus 8 $(which draftheads) train --config configs/eagle3-llama3-8b-8gpu.yaml``.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML (see configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. train.max_steps=20 data.limit=50",
    )
    # The deepspeed launcher passes --local_rank=N (older versions) besides setting LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from draftheads.base_model import BaseModelError
    from draftheads.config import load_run_config
    from draftheads.data.sources import DataError
    from draftheads.heads import HeadMismatchError
    from draftheads.optional import MissingDependencyError, require_extra
    from draftheads.settings import ConfigError

    try:
        require_extra("train", "draftheads train")
    except MissingDependencyError as err:
        print(f"draftheads train: {err}")
        return 2
    from draftheads.train.loop import run_training

    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        run_training(load_run_config(args.config, args.overrides))
    except (ConfigError, DataError, BaseModelError, HeadMismatchError) as err:  # bad input: no traceback
        print(f"draftheads train: {err}")
        return 2
    return 0
