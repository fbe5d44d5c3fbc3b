"""``draftheads train --config FILE [key=value ...]``: train a draft head on a base model.

Runs as a single process on a CPU, or under the DeepSpeed launcher on GPUs:
``deepspeed --num_gpus 8 $(which draftheads) train --config configs/llama3-8b_eagle3_8gpu.yaml``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML (see configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. train.max_steps=20 data.limit=50",
    )
    parser.add_argument(
        "--allow-changed-data",
        action="store_true",
        help="with train.resume: go on although data.* or the batch size changed since the checkpoint "
        "(the head's training record lists every data source)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="train again into a finished run's train.output_dir (its head/ and no checkpoint left to "
        "resume), replacing its head, metrics.jsonl and config.json",
    )


def print_data_summary(run_config) -> None:
    """Build (or load from the cache) the run's datasets and print what reading the data dropped,
    as ``data inspect`` does, before the base model loads; the training loop then hits the cache.
    Too many dropped records raise ``DataError`` here. Under the DeepSpeed launcher only rank 0
    builds and prints: the others read its cache in the loop, after a barrier."""
    from draftheads.base_model import load_tokenizer
    from draftheads.commands.data import format_drop_summary
    from draftheads.data.pipeline import build_datasets

    if os.environ.get("RANK", "0") != "0":
        return
    tokenizer = load_tokenizer(run_config.model.base)
    _, _, report = build_datasets(run_config.data, tokenizer, run_config.model.base)
    print(format_drop_summary(report), flush=True)


def run(args: argparse.Namespace) -> int:
    from draftheads.config import load_run_config
    from draftheads.optional import require_extra

    # A missing extra (MissingDependencyError), bad input (ConfigError, DataError), a head that does
    # not fit (HeadMismatchError), a refused output directory and a full disk end the command as one
    # line with the exit status of their kind, in draftheads.cli.main.
    require_extra("train", "draftheads train")
    from draftheads.train.loop import run_training
    from draftheads.train.run_dir import check_output_dir

    run_config = load_run_config(args.config, args.overrides)
    # Refuse an output directory before the data or a model loads (the loop checks again,
    # under the directory's lock).
    check_output_dir(Path(run_config.train.output_dir), run_config.train.resume, args.overwrite)
    print_data_summary(run_config)
    run_training(run_config, allow_changed_data=args.allow_changed_data, overwrite=args.overwrite)
    return 0
