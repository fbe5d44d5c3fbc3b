"""Prepacked linear layers (``draftheads.infer.packed``): the same linear map as ``F.linear`` for any
row count, transparent to the module (parameters, state dict, autograd), re-packed after in-place
weight changes, and lossless decoding on a packed base model and head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftheads.heads import Eagle3Config, MedusaConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.generate import default_pad_to_multiple
from draftheads.infer.packed import PackedLinear, has_packed_linears, pack_linears, packing_supported
from tests.conftest import make_tiny_llama

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(
        not packing_supported(nn.Linear(2, 2)), reason="this torch build or CPU has no oneDNN fp32 packing"
    ),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 33])
def test_packed_linear_is_the_same_map(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 200, bias=bias)
    packed = PackedLinear.wrap(linear)
    x = torch.randn(1, rows, 48)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight and packed.bias is linear.bias


def test_pack_linears_keeps_the_module_and_is_idempotent():
    model = make_tiny_llama()
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert has_packed_linears(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[name].data_ptr() == before[name] for name in before)  # the very same storage
    assert pack_linears(model) == 0
    # several modules at once (a base model and its head): each counted, an unsupported one skipped
    assert (
        pack_linears(make_tiny_llama(), make_tiny_llama().to(torch.bfloat16), make_tiny_llama())
        == 2 * linears
    )


def test_in_place_weight_change_is_repacked():
    torch.manual_seed(0)
    packed = PackedLinear.wrap(nn.Linear(16, 32))
    x = torch.randn(4, 16)
    with torch.no_grad():
        packed(x)
        packed.weight.mul_(2.0)  # as an adapter merge or a checkpoint load would
        torch.testing.assert_close(packed(x), F.linear(x, packed.weight, packed.bias), rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_default_kernel():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    packed = PackedLinear.wrap(nn.Linear(16, 8))
    packed.load_state_dict(linear.state_dict())
    x = torch.randn(3, 16)
    packed(x).square().sum().backward()
    linear(x).square().sum().backward()
    torch.testing.assert_close(packed.weight.grad, linear.weight.grad)


def test_not_applied_to_bf16():
    model = make_tiny_llama().to(torch.bfloat16)
    assert not packing_supported(model)
    assert pack_linears(model) == 0
    assert not has_packed_linears(model)


def test_padding_default_follows_the_kernels():
    model = make_tiny_llama()
    assert default_pad_to_multiple(model) == 4  # MKL: 2-3 rows cost as much as 4
    pack_linears(model)
    assert default_pad_to_multiple(model) == 1


@pytest.mark.parametrize(
    "config,tree",
    [
        (MedusaConfig(num_heads=3, num_layers=1), "cpu-8"),
        (Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), "dynamic-cpu"),
    ],
    ids=["medusa", "eagle3"],
)
def test_greedy_on_packed_layers_matches_unpacked_generate(config, tree):
    reference = make_tiny_llama()
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, config)
    pack_linears(model, head)
    generator = SpeculativeGenerator(model, head, tree=tree)
    assert generator.pad_to_multiple == 1
    generator_seed = torch.Generator().manual_seed(5)
    for index in range(3):
        prompt = torch.randint(3, 256, (1, 6 + 5 * index), generator=generator_seed)
        expected = reference.generate(prompt, max_new_tokens=48, do_sample=False)
        assert generator.generate(prompt, max_new_tokens=48).sequences.tolist() == expected.tolist(), index
