"""Medusa: distinct residual blocks, zero-initialised start, shared or own vocab projections."""

from __future__ import annotations

import torch
from head_fixtures import base_hidden_states

from draftheads.heads import MedusaConfig, build_head


def test_blocks_are_distinct_modules(tiny_llama):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=3))
    blocks = [block for medusa_head in head.heads for block in medusa_head.blocks]
    assert len(blocks) == 6
    assert len({id(block) for block in blocks}) == 6
    assert len({block.linear.weight.data_ptr() for block in blocks}) == 6
    hidden = 64
    expected = 2 * 3 * (hidden * hidden + hidden) + 2 * 256 * hidden
    assert sum(parameter.numel() for parameter in head.parameters()) == expected


def test_a_fresh_head_is_the_base_lm_head(tiny_llama):
    head = build_head(tiny_llama, MedusaConfig(num_heads=3, num_layers=2))
    features = base_hidden_states(tiny_llama, torch.randint(3, 256, (2, 7)))[-1]
    with torch.no_grad():
        logits = head.draft_logits(features)
        base_logits = tiny_llama.lm_head(features)
    assert logits.shape == (2, 7, 3, 256)
    for k in range(3):
        assert torch.equal(logits[:, :, k], base_logits)
    assert head.num_draft_steps == 3


def test_shared_lm_head_has_no_projection_weights(tiny_llama):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1, shared_lm_head=True))
    names = list(head.state_dict())
    assert names == [
        "heads.0.blocks.0.linear.weight",
        "heads.0.blocks.0.linear.bias",
        "heads.1.blocks.0.linear.weight",
        "heads.1.blocks.0.linear.bias",
    ]
    features = torch.randn(1, 3, 64)
    with torch.no_grad():
        assert torch.equal(head.draft_logits(features)[:, :, 1], tiny_llama.lm_head(features))


def test_own_lm_heads_start_as_copies_not_aliases(tiny_llama):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2))
    own = [medusa_head.lm_head.weight for medusa_head in head.heads]
    assert all(torch.equal(weight, tiny_llama.lm_head.weight) for weight in own)
    assert len({weight.data_ptr() for weight in own + [tiny_llama.lm_head.weight]}) == 3
