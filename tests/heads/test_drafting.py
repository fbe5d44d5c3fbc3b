"""Autoregressive drafting: catch_up/draft_step shapes, cache correctness, and agreement between
the training forwards and the inference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from head_fixtures import AUTOREGRESSIVE_KINDS, HEAD_CONFIGS, base_hidden_states, move_norms_off_unit_weight

from draftheads.heads import build_head
from draftheads.heads.layers import prefix_and_self_mask, prefix_causal_mask

LENGTH = 9
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def sequence(tiny_llama):
    input_ids = torch.randint(3, 256, (2, LENGTH + 1), generator=torch.Generator().manual_seed(3))
    hidden_states = base_hidden_states(tiny_llama, input_ids)
    positions = torch.arange(LENGTH + 1)[None].expand(2, LENGTH + 1)
    return input_ids, hidden_states, positions


def make_head(kind, model):
    torch.manual_seed(0)
    return build_head(model, HEAD_CONFIGS[kind]).eval()


def crop_to(cache, length):
    """transformers 5 ``crop`` takes the (negative) number of entries to drop."""
    excess = cache.get_seq_length() - length
    if excess:
        cache.crop(-excess)


def cached_keys(head, cache):
    return [layer.keys for part in head.draft_caches(cache) for layer in part.layers]


@pytest.mark.parametrize("kind", AUTOREGRESSIVE_KINDS)
def test_catch_up_at_once_equals_position_by_position(kind, tiny_llama, sequence):
    input_ids, hidden_states, positions = sequence
    head = make_head(kind, tiny_llama)
    features = head.select_features(hidden_states)[:, :LENGTH]  # positions 0..8; token 9 is the last known
    next_tokens, positions = input_ids[:, 1:], positions[:, :LENGTH]
    with torch.no_grad():
        whole = head.new_cache()
        hidden, logits = head.catch_up(whole, features, next_tokens, positions)
        stepwise = head.new_cache()
        for i in range(LENGTH):
            step_hidden, step_logits = head.catch_up(
                stepwise, features[:, i : i + 1], next_tokens[:, i : i + 1], positions[:, i : i + 1]
            )
        # and in uneven chunks
        chunked = head.new_cache()
        for start, end in ((0, 4), (4, 5), (5, LENGTH)):
            chunk_hidden, chunk_logits = head.catch_up(
                chunked, features[:, start:end], next_tokens[:, start:end], positions[:, start:end]
            )
    assert hidden.shape == (2, 64)
    assert logits.shape == (2, 64 if kind == "eagle3" else 256)
    for other_hidden, other_logits, other_cache in (
        (step_hidden, step_logits, stepwise),
        (chunk_hidden, chunk_logits, chunked),
    ):
        torch.testing.assert_close(other_hidden, hidden, **TOLERANCE)
        torch.testing.assert_close(other_logits, logits, **TOLERANCE)
        for expected, actual in zip(cached_keys(head, whole), cached_keys(head, other_cache), strict=True):
            torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_mtp_modules_lag_by_the_tokens_they_need(tiny_llama, sequence):
    input_ids, hidden_states, positions = sequence
    head = make_head("mtp", tiny_llama)
    with torch.no_grad():
        cache = head.new_cache()
        head.catch_up(
            cache, head.select_features(hidden_states)[:, :LENGTH], input_ids[:, 1:], positions[:, :LENGTH]
        )
    # Module k at position i needs t_{i+k}; t_9 is the newest token, so module k reached 9 - k.
    assert [part.get_seq_length() for part in head.draft_caches(cache)] == [9, 8, 7]
    assert cache.pending_hidden[0] is None
    assert [cache.pending_positions[k][0].tolist() for k in (1, 2)] == [[8], [7]]


def test_eagle_catch_up_matches_the_training_forward(tiny_llama, sequence):
    from draftheads.heads.layers import padded_causal_mask

    input_ids, hidden_states, positions = sequence
    head = make_head("eagle", tiny_llama)
    features = head.select_features(hidden_states)[:, :LENGTH]
    with torch.no_grad():
        mask = padded_causal_mask(None, 2, LENGTH, features.dtype, features.device)
        trained = head.predict_features(features, input_ids[:, 1:], positions[:, :LENGTH], mask)
        hidden, logits = head.catch_up(head.new_cache(), features, input_ids[:, 1:], positions[:, :LENGTH])
    torch.testing.assert_close(hidden, trained[:, -1], **TOLERANCE)
    torch.testing.assert_close(logits, tiny_llama.lm_head(trained[:, -1]), **TOLERANCE)


def test_mtp_catch_up_matches_the_training_forward(tiny_llama, sequence):
    input_ids, hidden_states, positions = sequence
    head = make_head("mtp", tiny_llama)
    features = head.select_features(hidden_states)
    with torch.no_grad():
        states = head.unroll(features, input_ids, None)  # row i of module k uses t_{i+k}
        hidden, logits = head.catch_up(
            head.new_cache(), features[:, :LENGTH], input_ids[:, 1:], positions[:, :LENGTH]
        )
    torch.testing.assert_close(hidden, states[0][:, LENGTH - 1], **TOLERANCE)
    torch.testing.assert_close(logits, head.module_logits(0, states[0][:, LENGTH - 1]), **TOLERANCE)


EAGLE3_VARIANTS = {
    "one-layer": {},
    "two-layers": {"num_layers": 2},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}


@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_eagle3_training_time_test_equals_drafting_a_chain(tiny_llama, sequence, variant):
    """TTT step j at row i must compute what inference computes for a depth-j chain node after
    catching up to position i: the same keys (prefix + own ancestors), positions and inputs, in
    every draft layer's cache slot (and, with EAGLE-3.1's norm_output, the same normed state)."""
    input_ids, hidden_states, positions = sequence
    torch.manual_seed(0)
    config = dataclasses.replace(HEAD_CONFIGS["eagle3"], **EAGLE3_VARIANTS[variant])
    num_layers = config.num_layers
    head = build_head(tiny_llama, config).eval()
    move_norms_off_unit_weight(head, seed=6)
    features = head.select_features(hidden_states)  # (2, 10, 3h)
    row = 4
    with torch.no_grad():
        states = head.training_time_test(features, input_ids, None).states  # 3 x (2, 10, h)
        cache = head.new_cache()
        hidden, _ = head.catch_up(
            cache, features[:, : row + 1], input_ids[:, 1 : row + 2], positions[:, : row + 1]
        )
        assert len(cache.layers) == num_layers
        torch.testing.assert_close(hidden, states[0][:, row], **TOLERANCE)
        for depth in (1, 2):
            past = cache.get_seq_length()
            token = input_ids[:, row + depth + 1 : row + depth + 2]  # the chain's true next token
            position = torch.full((2, 1), row + depth)
            mask = prefix_causal_mask(2, past, 1, hidden.dtype, hidden.device)  # prefix + ancestors + self
            hidden, logits = head.draft_step(cache, depth, hidden[:, None], token, position, mask)
            hidden = hidden[:, 0]
            torch.testing.assert_close(hidden, states[depth][:, row], **TOLERANCE)
            torch.testing.assert_close(logits[:, 0], head.logits(states[depth][:, row]), **TOLERANCE)


def test_eagle3_training_time_test_on_picked_rows_equals_every_row(tiny_llama, sequence):
    """Steps after the first run on the picked rows alone and give what the full unroll gives there
    (batch rows picking different counts, one picking none)."""
    input_ids, hidden_states, _ = sequence
    head = make_head("eagle3", tiny_llama)
    features = head.select_features(hidden_states)  # (2, 10, 3h)
    rows = torch.zeros(2, 10, dtype=torch.bool)
    rows[0, [1, 4, 5, 9]] = True
    with torch.no_grad():
        full = head.training_time_test(features, input_ids, None)
        picked = head.training_time_test(features, input_ids, None, rows)
        empty = head.training_time_test(features, input_ids, None, torch.zeros_like(rows))
    assert picked.chains.index[0].tolist() == [1, 4, 5, 9] and (picked.chains.chain_steps[0] > 0).all()
    assert not (picked.chains.chain_steps[1] > 0).any() and not (empty.chains.chain_steps > 0).any()
    # Rows 0..7 consume real tokens at every step (row 9 reads past the end from step 0 on: padding).
    for step, (dense, sparse) in enumerate(zip(full.states, picked.states)):
        for slot, row in enumerate([1, 4, 5]):
            if row + step + 1 < 10:
                torch.testing.assert_close(sparse[0, slot], dense[0, row], **TOLERANCE)


@pytest.mark.parametrize("kind", ("eagle3", "peagle"))
def test_training_time_test_on_chains_of_several_lengths_equals_every_row(kind, tiny_llama, sequence):
    """Chains that stop at different steps (COD sampling) give what the full unroll gives at every
    step they reach; a step runs on the chains reaching it alone, longest first."""
    input_ids, hidden_states, _ = sequence
    head = make_head(kind, tiny_llama)
    features = head.select_features(hidden_states)  # (2, 10, 3h)
    chain_steps = torch.zeros(2, 10, dtype=torch.long)
    chain_steps[0, [1, 2, 4, 5]] = torch.tensor([1, 3, 2, 3])
    chain_steps[1, [0, 6]] = torch.tensor([2, 1])
    with torch.no_grad():
        full = head.training_time_test(features, input_ids, None)
        picked = head.training_time_test(features, input_ids, None, chain_steps)
    assert picked.chains.index[0].tolist() == [2, 5, 4, 1] and picked.chains.chain_steps[0].tolist() == [
        3,
        3,
        2,
        1,
    ]
    assert [state.shape[1] for state in picked.states] == [4, 3, 2]
    for step, dense in enumerate(full.states):
        index, reaches = picked.at_step(step)
        for batch_row in range(2):
            for slot in reaches[batch_row].nonzero().flatten().tolist():
                row = int(index[batch_row, slot])
                if row + step + 1 < 10:
                    torch.testing.assert_close(
                        picked.states[step][batch_row, slot], dense[batch_row, row], **TOLERANCE
                    )


@pytest.mark.parametrize("kind", ("eagle", "eagle3"))
def test_draft_step_on_a_frontier_matches_per_node_steps(kind, tiny_llama, sequence):
    """N sibling nodes drafted together (prefix + self mask) equal each drafted alone."""
    input_ids, hidden_states, positions = sequence
    head = make_head(kind, tiny_llama)
    features = head.select_features(hidden_states)[:, :LENGTH]
    nodes = torch.tensor([[5, 17, 99], [3, 4, 250]])  # (B, N)
    with torch.no_grad():
        cache = head.new_cache()
        root_hidden, _ = head.catch_up(cache, features, input_ids[:, 1:], positions[:, :LENGTH])
        past = cache.get_seq_length()
        parents = root_hidden[:, None].expand(2, 3, 64)
        node_positions = torch.full((2, 3), LENGTH)
        mask = prefix_and_self_mask(2, past, 3, parents.dtype, parents.device)
        together, together_logits = head.draft_step(cache, 1, parents, nodes, node_positions, mask)
        assert together.shape == (2, 3, 64)
        assert together_logits.shape == (2, 3, 64 if kind == "eagle3" else 256)
        assert cache.get_seq_length() == past + 3
        for n in range(3):
            crop_to(cache, past)
            alone, _ = head.draft_step(
                cache,
                1,
                parents[:, n : n + 1],
                nodes[:, n : n + 1],
                node_positions[:, n : n + 1],
                prefix_causal_mask(2, past, 1, parents.dtype, parents.device),
            )
            torch.testing.assert_close(alone[:, 0], together[:, n], **TOLERANCE)


def test_mtp_draft_step_uses_the_next_module_at_the_root_position(tiny_llama, sequence):
    input_ids, hidden_states, positions = sequence
    head = make_head("mtp", tiny_llama)
    features = head.select_features(hidden_states)[:, :LENGTH]
    nodes = torch.tensor([[5, 17], [3, 4]])
    with torch.no_grad():
        cache = head.new_cache()
        root_hidden, _ = head.catch_up(cache, features, input_ids[:, 1:], positions[:, :LENGTH])
        lengths = [part.get_seq_length() for part in head.draft_caches(cache)]
        parents = root_hidden[:, None].expand(2, 2, 64)
        node_positions = torch.full((2, 2), LENGTH - 1)
        built, built_logits = head.draft_step(cache, 1, parents, nodes, node_positions, None)
        assert built.shape == (2, 2, 64) and built_logits.shape == (2, 2, 256)
        assert [part.get_seq_length() for part in head.draft_caches(cache)] == [
            lengths[0],
            lengths[1] + 2,
            lengths[2],
        ]
        crop_to(head.draft_caches(cache)[1], lengths[1])
        mask = prefix_and_self_mask(2, lengths[1], 2, parents.dtype, parents.device)
        given, _ = head.draft_step(cache, 1, parents, nodes, node_positions, mask)
        torch.testing.assert_close(given, built, **TOLERANCE)
        crop_to(head.draft_caches(cache)[1], lengths[1])
        wrong = prefix_and_self_mask(2, lengths[0], 2, parents.dtype, parents.device)  # module 1's length
        with pytest.raises(ValueError, match="module 2's cache holds 8 rows"):
            head.draft_step(cache, 1, parents, nodes, node_positions, wrong)
        with pytest.raises(ValueError, match="drafts depths 1..2, got depth 3"):
            head.draft_step(cache, 3, parents, nodes, node_positions, None)
    assert head.num_draft_steps == 3 and head.drafting == "module-per-depth"
