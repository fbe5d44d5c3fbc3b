"""Drafting with int8 linear weights (``draftheads.infer.int8``, ``draft_dtype="int8"``): the layer
computes the linear map within int8's rounding and follows its weight, ``prepare_head`` converts the head's
layers alone, and an int8-drafting head decodes exactly the base's greedy text (heads of every
kind, one prompt and a batch) and samples from the base's distribution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_precision import eagle3_head, prompts
from test_sampling import SAMPLES, TREE, VOCAB, chi_square_p_value, exact_first_two, sampling_model

from draftheads.heads import Eagle3Config, EagleConfig, MedusaConfig, build_head
from draftheads.infer import SpeculativeGenerator, precision
from draftheads.infer.int8 import Int8Linear, has_int8_linears, int8_supported, quantize_rows
from draftheads.infer.packed import PackedLinear, pack_linears
from draftheads.infer.precision import INT8, DraftDtypeError, draft_dtype, prepare_head
from draftheads.infer.tree import DynamicTree
from tests.conftest import make_tiny_llama

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not int8_supported(), reason="this torch build has no CPU int8 weight matmul"),
]


def test_rows_round_to_within_half_a_step_and_zero_rows_stay_zero():
    torch.manual_seed(0)
    weight = torch.randn(16, 40)
    weight[3] = 0
    rows, scales = quantize_rows(weight)
    assert rows.dtype == torch.int8 and scales.shape == (16,)
    assert rows.abs().max() <= 127 and bool((rows.abs().amax(dim=1)[torch.arange(16) != 3] == 127).all())
    error = (rows.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())
    assert bool((rows[3] == 0).all())


def test_the_layer_computes_the_linear_map_within_int8_rounding_and_follows_its_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 96)
    layer = Int8Linear.wrap(linear)
    x = torch.randn(5, 48)
    with torch.no_grad():
        expected = F.linear(x, linear.weight, linear.bias)
        out = layer(x)
        assert (out - expected).abs().max() < 0.02 * expected.abs().max()
        assert not torch.equal(out, expected)  # the int8 kernel ran, not F.linear
        torch.testing.assert_close(layer(x[None]), out[None])  # (B, T, h)
        layer.weight.mul_(2)  # changed in place: quantized again, not the stale copy
        doubled = F.linear(x, linear.weight, linear.bias)
        assert (layer(x) - doubled).abs().max() < 0.02 * doubled.abs().max()
    assert layer.weight is linear.weight and layer.bias is linear.bias
    out = layer(x.requires_grad_())  # autograd records: the exact float map
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))


def test_int8_converts_the_heads_linear_layers_alone_and_packing_leaves_them():
    model = make_tiny_llama()
    head = eagle3_head(model)
    linears = sum(type(m) is torch.nn.Linear for m in head.modules())
    base_weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert prepare_head(head, model, INT8) == INT8
    assert sum(isinstance(m, Int8Linear) for m in head.modules()) == linears
    assert all(p.dtype == torch.float32 for p in head.parameters())  # activations stay fp32
    pack_linears(head)
    assert not any(type(m) is PackedLinear for m in head.modules())
    assert all(torch.equal(tensor, base_weights[name]) for name, tensor in model.state_dict().items())
    assert not has_int8_linears(model)


def test_int8_is_refused_where_its_kernel_does_not_run(monkeypatch):
    model = make_tiny_llama()
    monkeypatch.setattr(precision, "int8_supported", lambda dtype: False)
    with pytest.raises(DraftDtypeError, match="int8: no int8 linear kernel here for a float32 base"):
        draft_dtype(eagle3_head(model), model, INT8)


HEADS = {
    "eagle3": lambda model: eagle3_head(model),
    "eagle": lambda model: build_head(model, EagleConfig()),  # drafts through the base's lm_head
    "medusa": lambda model: build_head(model, MedusaConfig(num_heads=3)),
}


@pytest.mark.parametrize("kind", sorted(HEADS))
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_int8_drafting_keeps_greedy_output_exact(kind, shape):
    model = make_tiny_llama()
    heads = []
    for _ in range(2):  # the same weights twice: one drafts in int8, one in fp32
        torch.manual_seed(0)
        heads.append(HEADS[kind](model))
    prepare_head(heads[0], model, INT8)
    wide = "cpu-8" if kind == "medusa" else DynamicTree("wide", top_k=3, depth=4, total_tokens=10)
    tree = "chain-4" if shape == "chain" else wide
    generator, reference = (SpeculativeGenerator(model, head, tree=tree) for head in heads)
    batch = prompts(4, seed=7)
    same_steps = 0
    for prompt in batch:
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        result = generator.generate(prompt, max_new_tokens=40)
        assert result.sequences.tolist() == expected.tolist()
        steps = reference.generate(prompt, max_new_tokens=40).stats.verification_steps
        same_steps += result.stats.verification_steps == steps
    assert same_steps >= 2  # int8 drafts mostly what fp32 drafts: the same steps on most prompts
    rows = generator.generate([p[0] for p in batch], max_new_tokens=40)
    for prompt, row in zip(batch, rows.results):
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1] :]
        assert row.new_tokens == expected.tolist()


def test_int8_drafting_samples_from_the_base_distribution():
    model = sampling_model()
    torch.manual_seed(3)
    head = build_head(model, Eagle3Config(feature_layers=(0, 1, 2), draft_vocab_size=VOCAB))
    prepare_head(head, model, INT8)
    generator = SpeculativeGenerator(model, head, tree=TREE)
    prompt = [1, 5, 7, 9]
    counts = torch.zeros(VOCAB, VOCAB)
    emitted = steps = 0
    for sample in range(SAMPLES):
        result = generator.generate(prompt, max_new_tokens=2, temperature=1.0, seed=5000 + sample)
        first, second = result.new_tokens
        counts[first, second] += 1
        emitted += result.stats.tau * result.stats.verification_steps
        steps += result.stats.verification_steps
    assert emitted / steps > 1.1, "drafts must get accepted for this test to mean anything"
    assert chi_square_p_value(counts, exact_first_two(model, 1.0, 0, 1.0, prompt)) > 1e-3
    # negative control: the same counts against the base's distribution at another temperature fail
    assert chi_square_p_value(counts, exact_first_two(model, 0.7, 0, 1.0, prompt)) < 1e-3
