"""Data-parallel ranks read disjoint micro-batches that together are what one process reads with
the same global batch (world size x accumulation micro-batches a step), epoch after epoch."""

from __future__ import annotations

import datasets
import pytest

from draftheads.config import TrainConfig
from draftheads.train.batching import BatchStream
from draftheads.train.setup import total_optimizer_steps


def _dataset(rows: int) -> datasets.Dataset:
    lengths = [3 + (7 * row) % 11 for row in range(rows)]
    return datasets.Dataset.from_dict(
        {
            "input_ids": [[5] * length for length in lengths],
            "loss_mask": [[1] * length for length in lengths],
            "length": lengths,
        }
    )


def _rows_read(stream: BatchStream, micro_batches: int) -> list[list[int]]:
    return [next(stream)["row_index"].tolist() for _ in range(micro_batches)]


@pytest.mark.parametrize(("world_size", "accumulation"), [(2, 1), (2, 2), (3, 1), (4, 2)])
def test_ranks_together_read_what_one_process_reads(world_size, accumulation):
    dataset = _dataset(29)  # 15 batches of 2 per epoch: an odd count, so no epoch splits evenly
    steps = 12  # several epochs
    one = BatchStream(dataset, 2, 0, seed=3)
    single = _rows_read(one, steps * world_size * accumulation)
    ranks = [BatchStream(dataset, 2, 0, seed=3, rank=r, world_size=world_size) for r in range(world_size)]
    per_rank = [_rows_read(stream, steps * accumulation) for stream in ranks]
    for step in range(steps):
        # The process accumulating world_size x accumulation micro-batches reads them in the
        # order (accumulation index, rank): micro-batch a * world_size + r of the step.
        expected = single[step * world_size * accumulation : (step + 1) * world_size * accumulation]
        got = [
            per_rank[rank][step * accumulation + index]
            for index in range(accumulation)
            for rank in range(world_size)
        ]
        assert got == expected


def test_each_epoch_is_split_into_disjoint_shards_that_cover_it():
    dataset = _dataset(29)
    world_size, per_epoch = 2, 15
    ranks = [BatchStream(dataset, 2, 0, seed=3, rank=r, world_size=world_size) for r in range(world_size)]
    for epoch in range(3):
        shards = [
            {
                index
                for global_index in range(per_epoch * epoch, per_epoch * (epoch + 1))
                if global_index % world_size == rank
                for index in stream.batch_rows(global_index)
            }
            for rank, stream in enumerate(ranks)
        ]
        assert not shards[0] & shards[1]
        assert shards[0] | shards[1] == set(range(29))


def test_a_position_resumes_only_with_its_world_size():
    dataset = _dataset(29)
    stream = BatchStream(dataset, 2, 0, seed=3, rank=1, world_size=2)
    _rows_read(stream, 5)
    state = stream.state_dict()
    assert state == {"micro_batches_read": 5, "world_size": 2}
    again = BatchStream(dataset, 2, 0, seed=3, rank=1, world_size=2)
    again.load_state_dict(state)
    assert _rows_read(again, 3) == _rows_read(stream, 3)
    single = BatchStream(dataset, 2, 0, seed=3)
    with pytest.raises(ValueError, match="written by 2 data-parallel processes, resumed with 1"):
        single.load_state_dict(state)


def test_epochs_count_the_micro_batches_of_every_rank():
    train = TrainConfig(epochs=2, max_steps=None, gradient_accumulation_steps=2)
    assert total_optimizer_steps(train, batches_per_epoch=15, world_size=1) == 15
    assert total_optimizer_steps(train, batches_per_epoch=15, world_size=2) == 8  # ceil(30 / 4)
