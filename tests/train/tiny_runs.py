"""Shared by the training tests: a predictable dataset and the head settings of tiny runs."""

from __future__ import annotations

import datasets

# `key=value` overrides for a tiny head of each kind (the tiny Llama's 4 layers, a 64-token draft vocab)
HEAD_OVERRIDES = {
    "medusa": ["head.kind=medusa", "head.num_heads=2"],
    "eagle": ["head.kind=eagle"],
    "eagle3": [
        "head.kind=eagle3",
        "head.feature_layers=[1,2,3]",
        "head.draft_vocab_size=64",
        "head.ttt_steps=2",
    ],
    "mtp": ["head.kind=mtp", "head.num_modules=2"],
}


def patterned_dataset(rows: int = 8, length: int = 24):
    """Rows that count up by a per-row stride: every next token is predictable from the context."""
    ids, masks = [], []
    for row in range(rows):
        stride, start = 1 + row % 3, 3 + 7 * row
        ids.append([3 + (start + stride * j) % 60 for j in range(length)])
        masks.append([0] * 4 + [1] * (length - 4))
    return datasets.Dataset.from_dict(
        {"input_ids": ids, "loss_mask": masks, "length": [length] * rows, "id": [str(i) for i in range(rows)]}
    )
