"""The block drafter (DFlash heads): greedy output token-for-token the base model's, with static
trees of several shapes and depths, padded and not, adaptive, in batches of ragged rows; T=1
samples following the base distribution; the drafter's bookkeeping (one head forward per step,
forks independent, tuning's path candidates equal to the proposed tree's)."""

from __future__ import annotations

import pytest
import torch

import draftheads.infer.generate as generate_module
from draftheads.heads import DFlashConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.block import BlockDrafter
from draftheads.infer.draft import drafter_for
from draftheads.infer.tree import StaticTree, resolve_tree
from tests.conftest import make_tiny_llama
from tests.infer.test_sampling import (
    CONTROL_SAMPLES,
    PROMPT,
    SAMPLES,
    VOCAB,
    chi_square_p_value,
    exact_first_two,
    forgetful_verifier,
)

pytestmark = pytest.mark.usefixtures("single_thread")

# (block size, tree, pad_to_multiple): trees deeper than the block are cut to its K - 1 depths.
GREEDY_CASES = [
    (5, "cpu-8", None),
    (5, "chain-4", 1),
    (5, "mc_sim_7b_63", None),
    (3, "cpu-16", 1),
    (8, ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)), None),
]


def prompts(count: int, seed: int, vocab_size: int = 256) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (1, n), generator=generator) for n in lengths]


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


def block_head(model, block_size: int = 5):
    torch.manual_seed(0)  # untrained heads are random: fix them
    return build_head(model, DFlashConfig(num_layers=2, block_size=block_size, feature_layers=(1, 2, 3)))


@pytest.mark.parametrize("block_size,tree,pad_to_multiple", GREEDY_CASES, ids=[str(i) for i in range(5)])
def test_greedy_matches_generate(model, block_size, tree, pad_to_multiple):
    head = block_head(model, block_size)
    generator = SpeculativeGenerator(model, head, tree=tree, pad_to_multiple=pad_to_multiple)
    assert generator.tree.depth <= block_size - 1
    for index, prompt in enumerate(prompts(3, seed=GREEDY_CASES.index((block_size, tree, pad_to_multiple)))):
        expected = model.generate(prompt, max_new_tokens=48, do_sample=False)
        result = generator.generate(prompt, max_new_tokens=48)
        assert result.sequences.tolist() == expected.tolist(), f"{tree} prompt {index}"
        assert result.stats.verification_steps + 1 == result.stats.forward_passes


def test_greedy_adaptive_and_ragged_batches_match_generate(model):
    head = block_head(model)
    for adaptive in (False, True):
        generator = SpeculativeGenerator(model, head, tree="cpu-8", adaptive=adaptive)
        rows = [prompt[0] for prompt in prompts(4, seed=11)]
        result = generator.generate(rows, max_new_tokens=24)
        for row, (prompt, row_result) in enumerate(zip(rows, result.results)):
            expected = model.generate(prompt[None], max_new_tokens=24, do_sample=False)
            assert row_result.sequences.tolist() == expected.tolist(), f"adaptive={adaptive} row {row}"


def test_a_dynamic_tree_is_refused(model):
    with pytest.raises(ValueError, match="static tree"):
        SpeculativeGenerator(model, block_head(model), tree="dynamic-cpu")


def start_drafter(model, head, prompt: torch.Tensor) -> tuple[BlockDrafter, int]:
    with torch.no_grad():
        output = model(prompt, output_hidden_states=True)
    root = int(output.logits[0, -1].argmax())
    drafter = drafter_for(head)
    drafter.start(output.hidden_states, prompt, root)
    return drafter, root


def test_the_drafter_is_registered_for_block_heads(model):
    assert isinstance(drafter_for(block_head(model)), BlockDrafter)


def test_one_head_forward_per_step_and_the_tree_holds_each_depths_top_k(model):
    head = block_head(model)
    prompt = prompts(1, seed=3)[0]
    drafter, root = start_drafter(model, head, prompt)
    calls = []
    original = head.draft_block
    head.draft_block = lambda *args: calls.append(1) or original(*args)
    tree = resolve_tree("cpu-8")
    draft = drafter.propose(root, prompt.shape[1], tree)
    candidates = drafter.path_candidates(root, prompt.shape[1], torch.tensor([1, 2, 3]), top_k=4)
    assert len(calls) == 1  # path_candidates at the same root reuses the block
    depths = draft.topology.depths[: tree.num_nodes]
    for node in range(1, tree.num_nodes):
        assert draft.tokens[node] == candidates[depths[node] - 1, tree.ranks[node]]
    assert draft.scores[0] == 1.0 and all(0 < s <= 1 for s in draft.scores[1:])


def test_block_logits_are_the_heads_at_the_committed_prefix(model):
    """After commits in pieces, the drafted block equals the head's block over the whole prefix at
    once (the context cache holds exactly the committed positions)."""
    head = block_head(model)
    sequence = prompts(1, seed=5)[0]
    with torch.no_grad():
        hidden_states = model(sequence, output_hidden_states=True).hidden_states
    features = head.select_features(hidden_states)  # (1, T, F)
    split, end = 6, sequence.shape[1] - 1
    drafter = drafter_for(head)
    drafter.prefill(features[:, :split], sequence[:, 1 : split + 1])
    drafter.propose(int(sequence[0, split]), split, resolve_tree("chain-2"))  # a block, then more commits
    drafter.commit(features[:, split:end], sequence[:, split + 1 : end + 1], split)
    drafted = drafter.path_candidates(int(sequence[0, end]), end, torch.tensor([0, 0, 0]), top_k=3)
    with torch.no_grad():
        whole = head.draft_block(head.new_cache(), features[:, :end], end, sequence[:, end])[0]  # (K-1, V)
    assert drafted.tolist() == torch.topk(whole, 3, dim=-1).indices.tolist()


def test_a_fork_leaves_the_original_untouched(model):
    head = block_head(model)
    prompt = prompts(1, seed=7)[0]
    drafter, root = start_drafter(model, head, prompt)
    fork = drafter.fork()
    fork.propose(root, prompt.shape[1], resolve_tree("cpu-8"))
    assert drafter.cache.get_seq_length() == 0 and len(drafter.pending) == 1
    assert fork.cache.get_seq_length() == prompt.shape[1]


def test_commits_out_of_order_are_refused(model):
    head = block_head(model)
    drafter, _ = start_drafter(model, head, prompts(1, seed=8)[0])
    with pytest.raises(ValueError, match="does not follow"):
        drafter.commit(torch.zeros(1, 1, 3 * 64), torch.zeros(1, 1, dtype=torch.long), 99)


# ---- sampling ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_model():
    model = make_tiny_llama(
        seed=2, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=64,
    )  # fmt: skip
    model.lm_head.weight.data *= 8  # sharp distributions, as test_sampling.py's model
    model.generation_config.eos_token_id = None
    return model


def block_first_two(model, samples: int) -> tuple[torch.Tensor, int]:
    """(V, V) counts of the first two tokens sampled at T=1 through a block head's wide tree, and
    how many samples got both from one verification (a draft token accepted)."""
    torch.manual_seed(0)
    head = build_head(model, DFlashConfig(num_layers=1, block_size=4, feature_layers=(0, 1, 2)))
    depth1 = tuple((rank,) for rank in range(8))  # half the vocabulary: acceptances are frequent
    tree = StaticTree("wide", depth1 + ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0)))
    generator = SpeculativeGenerator(model, head, tree=tree)
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = 0
    for sample in range(samples):
        result = generator.generate(PROMPT, max_new_tokens=2, temperature=1.0, seed=2000 + sample)
        first, second = result.new_tokens
        counts[first, second] += 1
        accepted += result.stats.verification_steps == 1
    return counts, accepted


def test_t1_sampling_matches_base_distribution(sampling_model):
    counts, accepted = block_first_two(sampling_model, SAMPLES)
    assert accepted > SAMPLES // 10, "drafts must be accepted for this test to mean anything"
    assert chi_square_p_value(counts, exact_first_two(sampling_model, 1.0, 0, 1.0)) > 1e-3


def test_negative_control_biased_verifier_fails(sampling_model, monkeypatch):
    monkeypatch.setattr(generate_module, "verify_tree", forgetful_verifier)
    counts, _ = block_first_two(sampling_model, CONTROL_SAMPLES)
    # The threshold the exact verifier passes above (measured here: p ~ 1e-4 for this bug).
    assert chi_square_p_value(counts, exact_first_two(sampling_model, 1.0, 0, 1.0)) < 1e-3
