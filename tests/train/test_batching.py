import datasets
import pytest
import torch

from draftheads.train.batching import BatchStream, collate, epoch_batches, fixed_batches


def _dataset(count=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (count,), generator=generator).tolist()
    return datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(5, 5 + n)) for n in lengths],
            "loss_mask": [[0] * 2 + [1] * (n - 2) for n in lengths],
            "length": lengths,
            "id": [f"row{i}" for i in range(count)],
        }
    )


def test_epoch_batches_are_deterministic_and_cover_every_row_once():
    lengths = [len(ids) for ids in _dataset()["input_ids"]]
    first = epoch_batches(lengths, 4, seed=3, epoch=0)
    assert first == epoch_batches(lengths, 4, seed=3, epoch=0)
    assert first != epoch_batches(lengths, 4, seed=3, epoch=1)
    assert first != epoch_batches(lengths, 4, seed=4, epoch=0)
    assert sorted(i for batch in first for i in batch) == list(range(len(lengths)))


def test_length_grouping_cuts_padding():
    lengths = [len(ids) for ids in _dataset(200)["input_ids"]]

    def padding(batches):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    grouped = epoch_batches(lengths, 4, seed=0, epoch=0, group_by_length=True)
    plain = epoch_batches(lengths, 4, seed=0, epoch=0, group_by_length=False)
    assert padding(grouped) < 0.2 * padding(plain)


def test_collate_pads_right_and_masks_padding():
    rows = [{"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}]
    batch = collate(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[7, 8, 9], [4, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3"):
        collate([{"input_ids": [1, 2, 3], "loss_mask": [1, 1], "id": "x"}], 0)


def test_stream_resumes_at_the_same_batch_across_epochs():
    dataset = _dataset(10)
    stream = BatchStream(dataset, batch_size=3, pad_token_id=0, seed=1)
    assert stream.batches_per_epoch() == 4
    for _ in range(6):  # into the second epoch
        next(stream)
    state = stream.state_dict()
    assert state == {"micro_batches_read": 6, "world_size": 1}
    expected = [next(stream)["input_ids"] for _ in range(5)]
    resumed = BatchStream(dataset, batch_size=3, pad_token_id=0, seed=1)
    resumed.load_state_dict(state)
    for want in expected:
        assert torch.equal(next(resumed)["input_ids"], want)


def test_ranks_get_disjoint_batches_that_cover_the_epoch():
    dataset = _dataset(23)  # 12 batches of 2 (the last of 1): 4 per rank
    streams = [BatchStream(dataset, 2, 0, seed=0, rank=r, world_size=3) for r in range(3)]
    shards = [[stream.batch_rows(stream.global_index(k)) for k in range(4)] for stream in streams]
    seen = [i for shard in shards for batch in shard for i in batch]
    assert sorted(seen) == list(range(23))


def test_a_position_from_before_world_sizes_were_recorded_resumes_one_process():
    dataset = _dataset(10)
    stream = BatchStream(dataset, batch_size=3, pad_token_id=0, seed=1)
    stream.load_state_dict({"epoch": 1, "index": 2})
    assert stream.state_dict() == {"micro_batches_read": 6, "world_size": 1}
    sharded = BatchStream(dataset, batch_size=3, pad_token_id=0, seed=1, rank=1, world_size=2)
    with pytest.raises(ValueError, match="resume it with one process"):
        sharded.load_state_dict({"epoch": 1, "index": 2})


def test_fixed_batches_do_not_depend_on_calls():
    dataset = _dataset(30)
    first = fixed_batches(dataset, 4, 0, seed=0, limit=3)
    again = fixed_batches(dataset, 4, 0, seed=0, limit=3)
    assert len(first) == 3
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(first, again))
