"""The world-size arithmetic of resuming with another number of processes (train/elastic.py);
the resumes themselves run in test_distributed_training.py."""

from __future__ import annotations

import pytest

from draftheads.settings import ConfigError
from draftheads.train.batching import BatchStream
from draftheads.train.elastic import align_accumulation, remap_data_position


def record(micro_batch: int, accumulation: int) -> dict:
    return {"train": {"micro_batch_size": micro_batch, "gradient_accumulation_steps": accumulation}}


def test_a_position_continues_at_the_next_global_micro_batch():
    from datasets import Dataset

    lengths = [3 + i % 4 for i in range(40)]
    rows = Dataset.from_dict(
        {"input_ids": [[1] * n for n in lengths], "loss_mask": [[1] * n for n in lengths]}
    )
    two = [BatchStream(rows, 2, 0, seed=1, rank=rank, world_size=2) for rank in range(2)]
    for _ in range(3):  # three steps of 2 ranks x accumulation 1
        for stream in two:
            next(stream)
    position = remap_data_position(two[0].state_dict(), 1, "step-3")
    one = BatchStream(rows, 2, 0, seed=1, rank=0, world_size=1)
    one.load_state_dict(position)
    assert one.global_index() == 6 == two[0].global_index()
    assert remap_data_position({"micro_batches_read": 6, "world_size": 1}, 2, "x")["micro_batches_read"] == 3


def test_a_position_that_the_new_processes_cannot_split_is_refused():
    with pytest.raises(ConfigError, match="9 micro-batches in all, which 2 processes cannot split"):
        remap_data_position({"micro_batches_read": 3, "world_size": 3}, 2, "step-3")


def test_accumulation_that_keeps_the_global_batch_is_no_change():
    aligned = align_accumulation(record(2, 1), record(2, 2), written=2, world_size=1)
    assert aligned == record(2, 2)
    assert align_accumulation(record(2, 1), record(2, 1), written=2, world_size=1) == record(2, 1)  # halved
    assert align_accumulation(record(2, 1), record(1, 4), written=2, world_size=1) == record(2, 1)  # rows
    assert align_accumulation(record(2, 1), record(2, 4), written=1, world_size=1) == record(2, 1)
