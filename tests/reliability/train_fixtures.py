"""Tiny training runs for the reliability tests: a predictable dataset and a short run config."""

from __future__ import annotations

from draftheads.config import load_run_config
from tests.train.tiny_runs import patterned_dataset as tiny_rows

MEDUSA = ["head.kind=medusa", "head.num_heads=2"]


def patterned_dataset(rows: int = 8, length: int = 16):
    """The training tests' predictable rows (``tiny_runs.patterned_dataset``), shorter by default."""
    return tiny_rows(rows, length)


def short_run(output_dir, *overrides, head=MEDUSA):
    """A few optimiser steps into ``output_dir``, a checkpoint every 2 steps, no timing pass."""
    return load_run_config(
        None,
        [
            *head,
            f"train.output_dir={output_dir}",
            "train.max_steps=4",
            "train.micro_batch_size=2",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_every=2",
            "train.eval_batches=1",
            "train.save_every=2",
            "train.keep_checkpoints=3",
            "train.base_throughput_batches=0",
            *overrides,
        ],
    )
