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


def test_a_head_trained_with_the_diagonal_attention_is_the_dense_one(monkeypatch, tmp_path, tiny_llama):
    """Six optimizer steps of an EAGLE-3 run through training-time test's diagonal attention and
    through the dense masked SDPA it replaced: the same head (to fp32 rounding), drafting the same
    tokens."""
    from draftheads.config import load_run_config
    from draftheads.heads import load_head, ttt_attention
    from draftheads.train.loop import run_training
    from tests.train.tiny_runs import HEAD_OVERRIDES, patterned_dataset

    def train(name):
        overrides = [
            f"train.output_dir={tmp_path / name}",
            "train.max_steps=6",
            "train.micro_batch_size=4",
            "train.learning_rate=1e-2",
            "train.warmup_steps=1",
            "train.eval_every=0",
            "train.save_every=0",
            "train.base_throughput_batches=0",
            "head.ttt_steps=3",
        ]
        dataset = patterned_dataset()
        config = load_run_config(None, HEAD_OVERRIDES["eagle3"] + overrides)
        run_training(config, tiny_llama, datasets=(dataset, dataset))
        return load_head(tmp_path / name / "head", tiny_llama)

    diagonal = train("diagonal")
    with monkeypatch.context() as patched:
        patched.setattr(ttt_attention, "step_attention", dense_step_attention)
        dense = train("dense")
    for (name, weight), (_, expected) in zip(
        diagonal.state_dict().items(), dense.state_dict().items(), strict=True
    ):
        # fp32 sums in another order through Adam steps at lr 1e-2 (measured over 10 steps:
        # 2.3e-5 at most, on weights of magnitude 0.14)
        torch.testing.assert_close(weight, expected, rtol=1e-4, atol=1e-4, msg=name)
    hidden_states = base_hidden_states(tiny_llama, torch.arange(3, 23)[None])
    features = diagonal.select_features(hidden_states)
    with torch.no_grad():
        drafted = diagonal.training_time_test(features, torch.arange(3, 23)[None], None).states
        expected = dense.training_time_test(features, torch.arange(3, 23)[None], None).states
    for state, reference in zip(drafted, expected, strict=True):
        assert torch.equal(diagonal.logits(state).argmax(-1), dense.logits(reference).argmax(-1))


def dense_step_attention(query, key, value, mask, scaling):
    """Training-time test's attention as it ran before: SDPA over every cached key, the mask dense."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask.dense(), scale=scaling
    )
    return output.transpose(1, 2).contiguous()
