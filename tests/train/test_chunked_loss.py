"""Losses scored a chunk of rows at a time (``draftheads.train.chunked_loss``) equal the loss over
all rows at once: the loss, its gradients and the accuracy counts, for every head kind, and for
EAGLE-3 under each objective."""

from __future__ import annotations

import pytest
import torch

from draftheads.heads import DFlashConfig, Eagle3Config, MedusaConfig, MtpConfig, PEagleConfig, build_head
from draftheads.train import chunked_loss
from draftheads.train.losses import EAGLE3_DECAY, eagle3_step_loss, eagle3_targets
from draftheads.train.metrics import base_hidden_states
from draftheads.train.objective import compute_objective, eagle3_target_table

HEADS = {
    "medusa": MedusaConfig(num_heads=2, num_layers=1),
    "mtp": MtpConfig(num_modules=2),
    "dflash": DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 3)),
    "peagle": PEagleConfig(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3),
    **{
        f"eagle3-{objective}": Eagle3Config(
            feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3, objective=objective
        )
        for objective in ("soft_ce", "log_acceptance", "kl_acceptance", "hass")
    },
    "eagle3-hard": Eagle3Config(
        feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3, hard_target_weight=0.3
    ),
}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture
def batch(tiny_llama):
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 256, (2, 14), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return input_ids, loss_mask, attention_mask, base_hidden_states(tiny_llama, input_ids, attention_mask)


def loss_and_gradients(head, batch):
    input_ids, loss_mask, attention_mask, hidden_states = batch
    output = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, sample_seed=7)
    parameters = [p for p in head.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(output.loss, parameters, allow_unused=True)
    return output, [g for g in gradients if g is not None]


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_one_row_chunks_equal_one_chunk(monkeypatch, tiny_llama, batch, kind):
    """A chunk of 1 logit is a chunk of one row: every row boundary, each recomputed in backward."""
    torch.manual_seed(0)
    head = build_head(tiny_llama, HEADS[kind]).train()
    whole, whole_gradients = loss_and_gradients(head, batch)
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 1)
    rows, rows_gradients = loss_and_gradients(head, batch)
    torch.testing.assert_close(rows.loss, whole.loss, **TOLERANCE)
    for name in ("top1_correct", "top5_correct", "counted"):
        torch.testing.assert_close(getattr(rows, name), getattr(whole, name), rtol=0, atol=0)
    assert len(rows_gradients) == len(whole_gradients)
    for gradient, expected in zip(rows_gradients, whole_gradients, strict=True):
        torch.testing.assert_close(gradient, expected, **TOLERANCE)
    assert whole.counted.sum() > 0


@pytest.mark.parametrize("objective", ["soft_ce", "kl_acceptance"])
def test_eagle3_chunked_loss_equals_the_loss_over_all_rows(monkeypatch, tiny_llama, batch, objective):
    """Against the loss written over whole tensors: every step's logits at once, the targets'
    fp32 softmax at once, ``eagle3_step_loss`` over them, steps weighted by 0.8^j."""
    input_ids, loss_mask, attention_mask, hidden_states = batch
    torch.manual_seed(0)
    head = build_head(
        tiny_llama,
        Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3, objective=objective),
    )
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 64 * 3)  # chunks of 3 rows
    chunked = compute_objective(head.eval(), hidden_states, input_ids, loss_mask, attention_mask).loss

    captured = {}
    unroll = head.training_time_test

    def capture(*args, **kwargs):
        captured["unrolled"] = unroll(*args, **kwargs)
        return captured["unrolled"]

    monkeypatch.setattr(head, "training_time_test", capture)
    compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    unrolled = captured["unrolled"]
    last = hidden_states[tiny_llama.config.num_hidden_layers]
    supervised = (loss_mask * attention_mask).bool()
    step_loss = eagle3_step_loss(objective)
    expected = 0.0
    for step, state in enumerate(unrolled.states):
        index, reaches = unrolled.at_step(step)
        target = index + 2 + step
        scored = reaches & (target < input_ids.shape[1]) & supervised.gather(1, target.clamp(max=13))
        batch_rows, slot = scored.nonzero(as_tuple=True)
        position = target[batch_rows, slot]
        with torch.no_grad():
            full = head.base_lm_head(last[batch_rows, position - 1])
            probs, usable = eagle3_targets(full[:, head.t2d], full.argmax(-1), head.t2d)
        expected = expected + EAGLE3_DECAY**step * step_loss(
            probs, head.logits(state[batch_rows, slot]), usable
        )
    torch.testing.assert_close(chunked, expected, **TOLERANCE)


def test_the_target_table_is_the_same_with_or_without_the_stored_argmax(monkeypatch, tiny_llama):
    torch.manual_seed(0)
    head = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    rows = torch.randn(9, tiny_llama.config.hidden_size)
    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 2 * tiny_llama.config.vocab_size)  # 2 rows a chunk
    projected = eagle3_target_table(head, rows, None)
    stored = eagle3_target_table(head, rows, head.base_lm_head(rows).argmax(-1))
    full = head.base_lm_head(rows)
    assert torch.equal(projected.target_ids, full.argmax(-1))
    torch.testing.assert_close(projected.draft_logits, full[:, head.t2d], **TOLERANCE)
    torch.testing.assert_close(stored.draft_logits, projected.draft_logits, **TOLERANCE)
    assert torch.equal(stored.in_draft_vocab, head.t2d[projected.target_ids])
