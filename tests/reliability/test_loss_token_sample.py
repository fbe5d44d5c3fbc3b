"""A row scores the same tokens wherever it is batched.

``train.loss_token_fraction`` scores a random sample of each row's tokens (and EAGLE adds feature
noise, DFlash picks anchors at random). Those draws must follow the row (run seed, epoch, dataset
row, position), not the batch it lands in: otherwise 2 ranks x micro-batch 4, 1 rank accumulating
2 micro-batches of 4, and 1 rank x micro-batch 8 train on different samples of the same rows.
"""

from __future__ import annotations

import datasets
import pytest
import torch

from draftheads.heads import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.train.batching import BatchStream
from draftheads.train.draws import row_seeds
from draftheads.train.objective import compute_objective
from draftheads.train.supervision import sample_keep
from tests.conftest import make_tiny_llama

SEED = 3
FRACTION = 0.5
HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=2),
    "eagle": EagleConfig(feature_noise=0.1),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2),
    "mtp": MtpConfig(num_modules=2),
    "dflash": DFlashConfig(block_size=4, feature_layers=(1, 2, 3), anchors_per_sequence=3),
}


def _rows(count: int = 12) -> datasets.Dataset:
    lengths = [9 + (5 * index) % 17 for index in range(count)]  # 9..25 tokens
    return datasets.Dataset.from_dict(
        {
            "input_ids": [list(range(5 + index, 5 + index + n)) for index, n in enumerate(lengths)],
            "loss_mask": [[0] * 3 + [1] * (n - 3) for n in lengths],
            "length": lengths,
        }
    )


def _kept_tokens_by_row(micro_batch_size: int, world_size: int, group_by_length: bool) -> dict:
    """Dataset row -> the positions of it that the loss-token sample keeps, over one epoch read
    as the training loop reads it (every rank's stream, seeds from ``row_seeds``)."""
    dataset = _rows()
    kept = {}
    for rank in range(world_size):
        stream = BatchStream(dataset, micro_batch_size, 0, SEED, group_by_length, rank, world_size)
        for _ in range(-(-stream.batches_per_epoch() // world_size)):
            batch = next(stream)
            seeds = row_seeds(SEED, int(batch["epoch"]), batch["row_index"])
            keep = sample_keep(seeds, batch["input_ids"].shape[1], FRACTION)  # (B, T)
            for slot, row in enumerate(batch["row_index"].tolist()):
                length = int(batch["attention_mask"][slot].sum())
                kept.setdefault(row, keep[slot, :length].nonzero().flatten().tolist())
    return kept


def test_the_sample_of_a_row_does_not_depend_on_slot_padding_micro_batch_or_rank():
    reference = _kept_tokens_by_row(micro_batch_size=8, world_size=1, group_by_length=True)
    assert sorted(reference) == list(range(12))
    for layout in [(4, 2, True), (4, 1, True), (3, 1, False), (1, 1, True), (2, 3, False)]:
        assert _kept_tokens_by_row(*layout) == reference, layout
    # A sample, not everything or nothing.
    kept = sum(len(positions) for positions in reference.values())
    assert 0.3 < kept / sum(_rows()["length"]) < 0.7


def test_another_epoch_or_seed_samples_other_tokens():
    rows = torch.arange(12)
    first = sample_keep(row_seeds(SEED, 0, rows), 25, FRACTION)
    assert torch.equal(first, sample_keep(row_seeds(SEED, 0, rows), 25, FRACTION))
    assert not torch.equal(first, sample_keep(row_seeds(SEED, 1, rows), 25, FRACTION))
    assert not torch.equal(first, sample_keep(row_seeds(SEED + 1, 0, rows), 25, FRACTION))


@pytest.fixture(scope="module")
def base():
    return make_tiny_llama()


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_a_row_trains_the_same_alone_or_padded_in_another_slot(base, kind):
    """Row 7 alone, and in slot 1 next to a longer row without supervised tokens (so the batch is
    padded past row 7 and the loss is row 7's alone): the same tokens scored, the same loss."""
    torch.manual_seed(0)
    head = build_head(base, HEAD_CONFIGS[kind]).train()
    ids = torch.randint(3, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    row = {"input_ids": ids[0, :20], "loss_mask": (torch.arange(20) >= 4).long()}

    def run(input_ids, loss_mask, attention_mask, rows):
        with torch.no_grad():
            hidden_states = base.model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
            output = compute_objective(
                head,
                hidden_states.hidden_states,
                input_ids,
                loss_mask,
                attention_mask,
                FRACTION,
                row_seeds(SEED, 0, rows),
            )
        return output.loss, output.counted

    alone_loss, alone_counted = run(row["input_ids"][None], row["loss_mask"][None], torch.ones(1, 20), [7])
    input_ids = torch.stack([ids[1], torch.cat([row["input_ids"], torch.zeros(10, dtype=torch.long)])])
    loss_mask = torch.zeros(2, 30, dtype=torch.long)
    loss_mask[1, :20] = row["loss_mask"]
    attention_mask = torch.ones(2, 30)
    attention_mask[1, 20:] = 0
    batched_loss, batched_counted = run(input_ids, loss_mask, attention_mask, [2, 7])
    assert alone_counted.sum() > 0
    assert torch.equal(batched_counted, alone_counted)
    torch.testing.assert_close(batched_loss, alone_loss, rtol=1e-4, atol=1e-5)
