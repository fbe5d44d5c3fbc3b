"""A head's rotary frequency tables stay fp32, equal to the base's, whatever dtype the head is cast
to: bf16 tables would put a rope_theta 5e5 head on positions the base never uses."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import HEAD_CONFIGS, make_tiny_llama

from draftheads.heads import build_head, load_head
from draftheads.heads.dflash import DFlashConfig

ROTARY_CONFIGS = {
    **{kind: config for kind, config in HEAD_CONFIGS.items() if kind != "medusa"},  # Medusa has no layers
    "dflash": DFlashConfig(num_layers=2, block_size=4, feature_layers=(1, 2, 3)),
}
CASTS = {
    "to": lambda head: head.to(dtype=torch.bfloat16),
    "bfloat16": lambda head: head.bfloat16(),  # what DeepSpeed's bf16 engine calls on its module
    "half": lambda head: head.half(),
}


def tables(module: torch.nn.Module) -> list[torch.Tensor]:
    return [buffer for name, buffer in module.named_buffers() if name.endswith("inv_freq")]


@pytest.fixture(scope="module")
def base():
    return make_tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})


@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("kind", ROTARY_CONFIGS)
def test_rotary_tables_stay_fp32_and_equal_to_the_bases_after_a_cast(kind, cast, base):
    head = build_head(base, ROTARY_CONFIGS[kind])
    CASTS[cast](head)
    expected = base.model.rotary_emb.inv_freq
    assert expected.dtype == torch.float32
    head_tables = tables(head)
    assert head_tables, "the head has rotary tables"
    for table in head_tables:
        assert table.dtype == torch.float32
        assert torch.equal(table, expected)
    assert next(head.parameters()).dtype != torch.float32  # the cast itself took place


@pytest.mark.parametrize("kind", ROTARY_CONFIGS)
def test_a_head_loaded_for_a_bf16_base_keeps_fp32_tables(kind, base, tmp_path):
    build_head(base, ROTARY_CONFIGS[kind]).save_pretrained(tmp_path / "head")
    bf16_base = make_tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    bf16_base.to(torch.bfloat16)
    loaded = load_head(tmp_path / "head", base_model=bf16_base)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for table in tables(loaded):
        assert table.dtype == torch.float32
        assert torch.equal(table, base.model.rotary_emb.inv_freq)


def test_the_positions_a_bf16_head_sees_are_the_bases():
    base = make_tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    head = build_head(base, ROTARY_CONFIGS["eagle3"]).to(torch.bfloat16)
    hidden = torch.zeros(1, 1, base.config.hidden_size, dtype=torch.bfloat16)
    position_ids = torch.tensor([[2000]])
    cos, sin = head.rotary_emb(hidden, position_ids)
    expected_cos, expected_sin = base.model.rotary_emb(hidden.float(), position_ids)
    torch.testing.assert_close(cos.float(), expected_cos, atol=1e-2, rtol=0)
    torch.testing.assert_close(sin.float(), expected_sin, atol=1e-2, rtol=0)
