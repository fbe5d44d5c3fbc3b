"""Drafting in another dtype than the base (``draftheads.infer.precision``): which dtype ``auto``
picks and when an explicit one is refused; the conversion touches the head's weights alone; and a
bf16-drafting EAGLE-3 head beside an fp32 base decodes exactly the base's greedy text (one prompt
and a batch, packed or not) and samples from the base's distribution."""

from __future__ import annotations

import pytest
import torch
from test_sampling import (
    SAMPLES,
    TREE,
    VOCAB,
    chi_square_p_value,
    exact_first_two,
    sampling_model,
)

from draftheads.heads import Eagle3Config, EagleConfig, build_head
from draftheads.infer import SpeculativeGenerator, precision
from draftheads.infer.packed import PackedLinear, can_pack, pack_linears
from draftheads.infer.precision import DraftDtypeError, draft_dtype, prepare_head
from draftheads.infer.tree import DynamicTree
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

EAGLE3 = Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64)
needs_bf16_packing = pytest.mark.skipif(
    not can_pack(torch.bfloat16), reason="this torch build or CPU packs no bf16 linears"
)


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def eagle3_head(model, seed: int = 0):
    torch.manual_seed(seed)
    return build_head(model, EAGLE3)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("pack", [True, False])
def test_auto_drafts_in_bf16_only_where_it_pays(model, monkeypatch, native, pack):
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    monkeypatch.setattr(precision, "can_pack", lambda dtype: True)
    expected = torch.bfloat16 if native and pack else torch.float32
    assert draft_dtype(eagle3_head(model), model, "auto", pack=pack) == expected
    # a head that drafts through the base's weights drafts in the base's dtype
    assert draft_dtype(build_head(model, EagleConfig()), model, "auto", pack=pack) == torch.float32


def test_auto_keeps_the_base_dtype_for_a_bf16_base(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    base = make_tiny_llama().to(torch.bfloat16)
    assert draft_dtype(eagle3_head(base), base, "auto") == torch.bfloat16  # the base's own


def test_explicit_dtypes_and_refusals(model):
    assert draft_dtype(eagle3_head(model), model, "bfloat16") == torch.bfloat16
    assert draft_dtype(eagle3_head(model), model, "float32") == torch.float32
    eagle = build_head(model, EagleConfig())
    assert draft_dtype(eagle, model, "float32") == torch.float32
    with pytest.raises(
        DraftDtypeError, match=r"draft dtype bfloat16: eagle heads draft through the base .* \(float32\)"
    ):
        draft_dtype(eagle, model, "bfloat16")
    with pytest.raises(DraftDtypeError, match=r"one of auto, float32, bfloat16, int8, got 'fp16'"):
        draft_dtype(eagle3_head(model), model, "fp16")


@pytest.mark.parametrize("pack", [True, False])
def test_conversion_touches_the_heads_weights_alone(model, pack):
    head = eagle3_head(model)
    buffers = {name: (tensor.dtype, tensor.clone()) for name, tensor in head.named_buffers()}
    base_weights = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    assert prepare_head(head, model, "bfloat16", pack=pack) == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in head.parameters())
    for name, tensor in head.named_buffers():  # rotary frequencies and the id maps are untouched
        assert tensor.dtype == buffers[name][0] and torch.equal(tensor, buffers[name][1]), name
    assert {name: tensor.dtype for name, tensor in model.state_dict().items()} == base_weights
    packed = [m for m in head.modules() if isinstance(m, PackedLinear)]
    assert bool(packed) == (pack and can_pack(torch.bfloat16))


@needs_bf16_packing
def test_a_packed_linear_follows_its_weight_into_bf16():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 96)
    packed = PackedLinear.wrap(linear)  # packed in fp32
    for parameter in packed.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    x = torch.randn(5, 48).to(torch.bfloat16)
    with torch.no_grad():
        out = packed(x)
        expected = torch.nn.functional.linear(x.float(), packed.weight.float(), packed.bias.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert packed._packed_dtype == torch.bfloat16  # re-packed, not the stale fp32 layout


def prompts(count: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 256, (1, int(torch.randint(4, 24, (), generator=generator))), generator=generator)
        for _ in range(count)
    ]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("tree", ["chain-4", DynamicTree("wide", top_k=3, depth=4, total_tokens=10)])
def test_bf16_drafting_keeps_greedy_output_exact(pack, tree):
    if pack and not can_pack(torch.bfloat16):
        pytest.skip("this torch build or CPU packs no bf16 linears")
    model = make_tiny_llama()
    head = eagle3_head(model)
    reference = eagle3_head(model)  # the same weights, drafting in fp32
    prepare_head(head, model, "bfloat16", pack=pack)
    if pack:
        pack_linears(model, reference)
    fast = SpeculativeGenerator(model, head, tree=tree)
    slow = SpeculativeGenerator(model, reference, tree=tree)
    batch = prompts(4, seed=7)
    proposals_agree = 0
    for prompt in batch:
        expected = model.generate(prompt, max_new_tokens=48, do_sample=False)
        result = fast.generate(prompt, max_new_tokens=48)
        assert result.sequences.tolist() == expected.tolist()
        proposals_agree += (
            result.stats.verification_steps
            == slow.generate(prompt, max_new_tokens=48).stats.verification_steps
        )
    assert proposals_agree >= 2  # bf16 drafts mostly what fp32 drafts: the same steps on most prompts
    rows = fast.generate([p[0] for p in batch], max_new_tokens=48)  # one batch: the rows' own texts
    for prompt, row in zip(batch, rows.results):
        expected = model.generate(prompt, max_new_tokens=48, do_sample=False)[0, prompt.shape[1] :]
        assert row.new_tokens == expected.tolist()


def test_bf16_drafting_samples_from_the_base_distribution():
    model = sampling_model()
    torch.manual_seed(3)
    head = build_head(model, Eagle3Config(feature_layers=(0, 1, 2), draft_vocab_size=VOCAB))
    prepare_head(head, model, "bfloat16")
    generator = SpeculativeGenerator(model, head, tree=TREE)
    prompt = [1, 5, 7, 9]
    counts = torch.zeros(VOCAB, VOCAB)
    emitted = steps = 0
    for sample in range(SAMPLES):
        result = generator.generate(prompt, max_new_tokens=2, temperature=1.0, seed=3000 + sample)
        first, second = result.new_tokens
        counts[first, second] += 1
        emitted += result.stats.tau * result.stats.verification_steps
        steps += result.stats.verification_steps
    assert emitted / steps > 1.1, "drafts must get accepted for this test to mean anything"  # 1.22 measured
    assert chi_square_p_value(counts, exact_first_two(model, 1.0, 0, 1.0, prompt)) > 1e-3
