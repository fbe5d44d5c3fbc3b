"""Tiny training runs for the reliability tests: a predictable dataset and a short run config."""

from __future__ import annotations

import datasets

from draftheads.config import load_run_config

MEDUSA = ["head.kind=medusa", "head.num_heads=2"]


def patterned_dataset(rows: int = 8, length: int = 16):
    """Rows that count up by a per-row stride: every next token is predictable from the context."""
    ids, masks = [], []
    for row in range(rows):
        stride, start = 1 + row % 3, 3 + 7 * row
        ids.append([3 + (start + stride * j) % 60 for j in range(length)])
        masks.append([0] * 4 + [1] * (length - 4))
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "length": [length] * rows, "id": [str(i) for i in range(rows)]}
    )


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
