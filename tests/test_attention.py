"""Folded grouped-query SDPA: the same attention as transformers' SDPA for tree masks over ragged
batch rows, greedy speculative decoding on a folded model identical to plain ``generate`` on an
unfolded one, and the switch applied only where it can be."""

from __future__ import annotations

import copy

import pytest
import torch

from draftheads.attention import (
    FOLDED_SDPA,
    fold_grouped_queries,
    folded_sdpa_attention,
    mask_repeats_shared,
    repeated_mask,
)
from draftheads.heads import Eagle3Config, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.cache import left_aligned_slots
from draftheads.infer.forward import prefill_rows, rows_forward
from draftheads.infer.tree import tree_topology
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def models():
    plain = make_tiny_llama()
    folded = copy.deepcopy(plain)
    assert fold_grouped_queries(folded)
    return plain, folded


def test_folding_switches_only_sdpa_models_with_grouped_queries(models):
    plain, folded = models
    assert plain.config._attn_implementation == "sdpa"
    assert folded.config._attn_implementation == FOLDED_SDPA
    assert not fold_grouped_queries(folded)  # already switched
    eager = make_tiny_llama()
    eager.config._attn_implementation = "eager"
    assert not fold_grouped_queries(eager)
    ungrouped = make_tiny_llama(num_key_value_heads=4)  # as many key/value heads as query heads
    assert not fold_grouped_queries(ungrouped)
    assert ungrouped.config._attn_implementation == "sdpa"


def test_folded_attention_equals_sdpa_for_trees_over_ragged_rows(models):
    """A prefill of rows of different lengths (left padding), then one verification forward of a
    different tree per row: the same logits and hidden states with and without folding."""
    plain, folded = models
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator) for n in (5, 23, 11)]
    parents = [[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]]  # a small tree, a chain, a fan
    topologies = [tree_topology(p) for p in parents]
    tokens = [torch.randint(3, 256, (4,), generator=generator) for _ in parents]
    outputs = []
    for model in (plain, folded):
        cache, logits, _ = prefill_rows(model, prompts, ())
        slots = left_aligned_slots([p.numel() for p in prompts], cache.get_seq_length())
        output = rows_forward(model, cache, tokens, topologies, slots, (1, 3))
        outputs.append((logits, output.logits, output.hidden_states))
    (prefill_a, tree_a, hidden_a), (prefill_b, tree_b, hidden_b) = outputs
    torch.testing.assert_close(prefill_a, prefill_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree_a, tree_b, atol=1e-5, rtol=1e-5)
    for a, b in zip(hidden_a, hidden_b):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(tree_a.argmax(-1), tree_b.argmax(-1))


def test_folded_function_against_repeated_heads_directly():
    """(B, H, N, D) queries over (B, H_kv, L, D) keys and values under a (B, 1, N, L) mask: the
    result of repeating each key/value head, head for head."""
    generator = torch.Generator().manual_seed(1)
    batch, heads, groups, queries, length, dim = 2, 6, 2, 5, 9, 8
    query = torch.randn(batch, heads, queries, dim, generator=generator)
    key = torch.randn(batch, groups, length, dim, generator=generator)
    value = torch.randn(batch, groups, length, dim, generator=generator)
    visible = torch.rand(batch, 1, queries, length, generator=generator) > 0.3
    visible[..., 0] = True  # every query sees something
    mask = torch.zeros(batch, 1, queries, length).masked_fill(~visible, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // groups
    output, _ = folded_sdpa_attention(module, query, key, value, mask)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), attn_mask=mask
    )
    torch.testing.assert_close(output, repeated.transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_a_mask_is_repeated_once_for_the_layers_of_a_forward():
    mask = torch.randn(2, 1, 3, 7)
    alone = repeated_mask(mask, 3)
    torch.testing.assert_close(alone, mask.repeat(1, 1, 3, 1), atol=0, rtol=0)
    assert repeated_mask(mask, 3) is not alone  # outside a forward nothing is kept
    with mask_repeats_shared():
        first = repeated_mask(mask, 3)
        torch.testing.assert_close(first, mask.repeat(1, 1, 3, 1), atol=0, rtol=0)
        assert repeated_mask(mask, 3) is first  # the next layer of the same forward
        assert repeated_mask(mask.clone(), 3) is not first  # equal values, another tensor
        torch.testing.assert_close(repeated_mask(mask, 2), mask.repeat(1, 1, 2, 1), atol=0, rtol=0)
    with mask_repeats_shared():  # the next forward starts afresh
        assert repeated_mask(mask, 3) is not first


def test_speculative_rows_on_a_folded_model_match_generate_on_an_unfolded_one(models):
    plain, folded = models
    torch.manual_seed(0)
    head = build_head(folded, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    generator = SpeculativeGenerator(folded, head, tree="chain-4", context=True)
    source = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=source) for n in (3, 40, 12, 7)]
    prompts = [torch.cat([p, p]) for p in prompts]  # repeats: context drafts are accepted
    result = generator.generate(prompts, max_new_tokens=24)
    for prompt, row in zip(prompts, result.results):
        expected = plain.generate(prompt[None], max_new_tokens=24, do_sample=False)[0]
        assert row.sequences[0].tolist() == expected.tolist()
    assert result.stats.tau > 1.0
