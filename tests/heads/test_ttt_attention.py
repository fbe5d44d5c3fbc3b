"""Training-time-test attention (``draftheads.heads.ttt_attention``) computes what one dense masked
SDPA over the whole draft cache computes: outputs and gradients, with padding, picked rows, chains
of several lengths, grouped queries and chunked queries; and a head trained through it is the one
the dense masks train."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import base_hidden_states

from draftheads.heads import Eagle3Config, PEagleConfig, build_head, ttt_attention
from draftheads.heads.layers import additive_mask, padded_causal_mask
from draftheads.heads.ttt_attention import StepMask, step_attention

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# Parameter gradients sum over every row and step of the unroll: fp32 sums in another order differ
# by a few 1e-5 (measured: 3e-5 at most, in 6 of 12,288 entries, with two draft layers).
GRADIENT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def dense_mask(mask: StepMask) -> torch.Tensor:
    """The mask training ran before: one additive (B, 1, R_j, T + R_1 + ... + R_j) tensor, query
    slot s seeing key slot s of each later step."""
    queries, batch = mask.prefix.shape[2], mask.prefix.shape[0]
    device, dtype = mask.prefix.device, mask.prefix.dtype
    blocks = [
        additive_mask(torch.eye(queries, width, dtype=torch.bool, device=device), dtype).expand(
            batch, 1, -1, -1
        )
        for width in mask.widths
    ]
    return torch.cat([mask.prefix, *blocks], dim=-1)


def dense_attention(query, key, value, mask: StepMask, scaling):
    """The reference: SDPA over every cached key with the mask written out, (B, R_j, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=dense_mask(mask), scale=scaling
    )
    return output.transpose(1, 2)


def random_step(widths, length=9, batch=2, heads=4, kv_heads=2, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    queries = widths[-1]
    keys = length + sum(widths)
    query = torch.randn(batch, heads, queries, dim, generator=generator, requires_grad=True)
    key = torch.randn(batch, kv_heads, keys, dim, generator=generator, requires_grad=True)
    value = torch.randn(batch, kv_heads, keys, dim, generator=generator, requires_grad=True)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    attention_mask[1, length - 3 :] = 0  # a padded batch row
    causal = padded_causal_mask(attention_mask, batch, length, torch.float32, "cpu")
    rows = torch.tensor([[0, 2, 3, 5, 8], [1, 4, 5, 6, 0]])[:, :queries]  # picked drafter rows
    prefix = causal[torch.arange(batch)[:, None], :, rows].transpose(1, 2)  # (B, 1, R_j, T)
    return query, key, value, StepMask(prefix, tuple(widths))


def outputs_and_gradients(attend, query, key, value, mask):
    output = attend(query, key, value, mask, 0.3)
    gradients = torch.autograd.grad(
        (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum(), (query, key, value)
    )
    return output, gradients


@pytest.mark.parametrize("widths", [(5,), (5, 5), (5, 4, 2), (3, 3, 3, 1)])
@pytest.mark.parametrize("chunk_scores", [ttt_attention.CHUNK_SCORES, 40])
def test_step_attention_equals_dense_masked_sdpa(monkeypatch, widths, chunk_scores):
    """Chunks of 40 scores over 4 heads and 2 rows are single query slots: every chunk boundary."""
    monkeypatch.setattr(ttt_attention, "CHUNK_SCORES", chunk_scores)
    query, key, value, mask = random_step(widths)
    output, gradients = outputs_and_gradients(step_attention, query, key, value, mask)
    expected, expected_gradients = outputs_and_gradients(dense_attention, query, key, value, mask)
    torch.testing.assert_close(output, expected, **TOLERANCE)
    for gradient, expected_gradient in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected_gradient, **TOLERANCE)


def test_a_missing_diagonal_is_caught():
    """Negative control: a mask that hides the step's own key gives other outputs than the step's."""
    query, key, value, mask = random_step((5, 4, 2))
    output = step_attention(query, key, value, mask, 0.3)
    wrong = dense_mask(mask).clone()
    wrong[..., -2:] = torch.finfo(wrong.dtype).min
    groups = query.shape[1] // key.shape[1]
    hidden_own = torch.nn.functional.scaled_dot_product_attention(
        query,
        key.repeat_interleave(groups, 1),
        value.repeat_interleave(groups, 1),
        attn_mask=wrong,
        scale=0.3,
    ).transpose(1, 2)
    assert not torch.allclose(output, hidden_own, **TOLERANCE)


def test_step_attention_without_gradients_equals_with_them():
    query, key, value, mask = random_step((5, 4, 2))
    with torch.no_grad():
        without = step_attention(query, key, value, mask, 0.3)
    torch.testing.assert_close(without, step_attention(query, key, value, mask, 0.3), rtol=0, atol=0)


def dense_step_attention(query, key, value, mask, scaling):
    return dense_attention(query, key, value, mask, scaling).contiguous()


def unrolled(head, features, input_ids, attention_mask, rows):
    result = head.training_time_test(features, input_ids, attention_mask, rows)
    total = sum((state * torch.linspace(-1, 1, state.shape[-1])).sum() for state in result.states)
    parameters = [p for p in head.parameters() if p.requires_grad]
    gradients = torch.autograd.grad(total, parameters, allow_unused=True)  # lm_head is not unrolled
    return result.states, [g for g in gradients if g is not None]


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("rows", ["every", "picked", "chains"])
def test_training_time_test_equals_the_dense_masked_unroll(monkeypatch, tiny_llama, kind, num_layers, rows):
    """The whole unroll, every draft layer, against the same unroll with each step's mask written
    out densely and run through SDPA (what training ran before): states and parameter gradients."""
    config_class = {"eagle3": Eagle3Config, "peagle": PEagleConfig}[kind]
    torch.manual_seed(0)
    head = build_head(
        tiny_llama,
        config_class(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=4, num_layers=num_layers),
    )
    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    features = head.select_features(base_hidden_states(tiny_llama, input_ids, attention_mask)).detach()
    picked = {
        "every": None,
        "picked": torch.rand(2, 12, generator=torch.Generator().manual_seed(1)) < 0.5,
        "chains": torch.randint(0, 5, (2, 12), generator=torch.Generator().manual_seed(2)),
    }[rows]
    states, gradients = unrolled(head, features, input_ids, attention_mask, picked)
    monkeypatch.setattr(ttt_attention, "step_attention", dense_step_attention)
    expected_states, expected_gradients = unrolled(head, features, input_ids, attention_mask, picked)
    for state, expected in zip(states, expected_states, strict=True):
        torch.testing.assert_close(state, expected, **TOLERANCE)
    for gradient, expected in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected, **GRADIENT_TOLERANCE)


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


def _saved_bytes(function) -> tuple[object, int]:
    """``function()``'s result and the bytes autograd saved for its backward pass."""
    saved = []

    def pack(tensor):
        saved.append(tensor.untyped_storage().nbytes() if tensor.device.type != "meta" else 0)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = function()
    return result, sum(saved)


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("rows", ["every", "chains"])
def test_gradient_checkpointing_recomputes_the_steps_exactly(tiny_llama, kind, rows):
    """With the steps recomputed in the backward pass (train.gradient_checkpointing) the states and
    every parameter's gradient are the kept unroll's, bit for bit, and autograd holds less."""
    config_class = {"eagle3": Eagle3Config, "peagle": PEagleConfig}[kind]
    torch.manual_seed(0)
    head = build_head(
        tiny_llama, config_class(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=4, num_layers=2)
    ).train()
    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    features = head.select_features(base_hidden_states(tiny_llama, input_ids, attention_mask)).detach()
    picked = (
        None if rows == "every" else torch.randint(0, 5, (2, 12), generator=torch.Generator().manual_seed(2))
    )

    def run():
        return unrolled(head, features, input_ids, attention_mask, picked)

    (states, gradients), kept_bytes = _saved_bytes(run)
    head.gradient_checkpointing_enable()
    (again, again_gradients), recomputed_bytes = _saved_bytes(run)
    for state, expected in zip(again, states, strict=True):
        assert torch.equal(state, expected)
    assert len(again_gradients) == len(gradients)
    for gradient, expected in zip(again_gradients, gradients, strict=True):
        assert torch.equal(gradient, expected)
    assert recomputed_bytes < 0.5 * kept_bytes, (recomputed_bytes, kept_bytes)


def test_a_kind_without_unrolled_passes_refuses_gradient_checkpointing(tiny_llama):
    from draftheads.config import load_run_config
    from draftheads.heads import MedusaConfig
    from draftheads.settings import ConfigError
    from draftheads.train.setup import check_gradient_checkpointing

    with pytest.raises(ValueError, match="medusa"):
        build_head(tiny_llama, MedusaConfig(num_heads=2)).gradient_checkpointing_enable()
    run = load_run_config(None, ["head.kind=medusa", "train.gradient_checkpointing=true"])
    with pytest.raises(ConfigError, match="train.gradient_checkpointing.*eagle3.*'medusa'"):
        check_gradient_checkpointing(run)
    check_gradient_checkpointing(
        load_run_config(None, ["head.kind=eagle3", "train.gradient_checkpointing=true"])
    )
