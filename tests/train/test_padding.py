"""The padding report, and the epoch order that keeps the ranks of a step on one length band."""

from __future__ import annotations

import random

import pytest

from draftheads.train import batching
from draftheads.train.batching import epoch_batches, fixed_batches
from draftheads.train.padding import padding_report


def test_the_report_counts_padding_and_waiting():
    """Seven rows of 10 tokens and one of 40: one micro-batch of 8 computes 8 x 40 positions for
    110 tokens; two ranks of 4 rows each hold 2 x 160 for the 160 + 40 they compute."""
    lengths = [10] * 7 + [40]
    one = padding_report(lengths, micro_batch_size=8, ranks=1, seed=0)
    assert (one.tokens, one.computed, one.held) == (110, 320, 320)
    assert one.padding == pytest.approx(1 - 110 / 320) and one.waiting == 0.0
    two = padding_report(lengths, micro_batch_size=4, ranks=2, seed=0)
    assert (two.computed, two.held) == (200, 320)
    assert two.waiting == pytest.approx(1 - 200 / 320)
    assert "padding: 45.0%" in two.line() and "wait 37.5%" in two.line()
    with pytest.raises(ValueError, match="must be >= 1"):
        padding_report(lengths, micro_batch_size=0, ranks=1, seed=0)


def long_tailed_lengths(rows: int = 8000) -> list[int]:
    generator = random.Random(0)
    return [min(2048, max(16, int(generator.lognormvariate(6, 0.9)))) for _ in range(rows)]


@pytest.mark.parametrize("ranks", [2, 8])
def test_the_ranks_of_a_step_get_batches_of_one_length_band(monkeypatch, ranks):
    """With blocks of neighbouring batches kept together, 8 ranks at micro-batch 4 wait a few
    percent of a step; the negative control, batches shuffled one by one, waits far longer."""
    lengths = long_tailed_lengths()
    blocked = padding_report(lengths, 4, ranks, seed=0)
    assert blocked.padding < 0.05 and blocked.waiting < 0.05, blocked
    monkeypatch.setattr(batching, "RANK_BLOCK", 1)
    shuffled = padding_report(lengths, 4, ranks, seed=0)
    assert shuffled.waiting > 3 * blocked.waiting, (shuffled, blocked)


def test_blocks_keep_every_row_once_and_depend_on_seed_and_epoch_alone():
    lengths = long_tailed_lengths(3000)
    batches = epoch_batches(lengths, 4, seed=1, epoch=2)
    assert sorted(row for batch in batches for row in batch) == list(range(3000))
    assert batches == epoch_batches(lengths, 4, seed=1, epoch=2)
    assert batches != epoch_batches(lengths, 4, seed=1, epoch=3)


def test_a_limited_evaluation_spans_the_length_bands():
    """Evaluation takes its first batches: shuffled one by one, they are not all of one block."""
    lengths = long_tailed_lengths(4000)
    dataset = [{"input_ids": [1] * length, "loss_mask": [1] * length} for length in lengths]

    class Rows(list):
        column_names = ("input_ids", "loss_mask")

        def __getitem__(self, key):
            if key == "input_ids":
                return [row["input_ids"] for row in self]
            return super().__getitem__(key)

    first = fixed_batches(Rows(dataset), 4, pad_token_id=0, seed=0, limit=16)
    longest = sorted(batch["input_ids"].shape[1] for batch in first)
    assert longest[-1] > 2 * longest[0], longest
