"""The acceptance rules as pure functions on synthetic tree logits."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftheads.infer.tree import tree_topology
from draftheads.infer.verify import (
    SamplingParams,
    target_probabilities,
    verify_greedy,
    verify_sampling,
    verify_tree,
    verify_typical,
)

# root 0 -> children 1 (token 2), 2 (token 3); node 1 -> child 3 (token 4)
TOPOLOGY = tree_topology([-1, 0, 0, 1])
TOKENS = torch.tensor([1, 2, 3, 4])


def test_greedy_walks_argmax():
    logits = torch.zeros(4, 8)
    logits[0, 2] = logits[1, 4] = logits[3, 6] = 1.0
    assert verify_greedy(logits, TOKENS, TOPOLOGY).nodes == (0, 1, 3)
    assert verify_greedy(logits, TOKENS, TOPOLOGY).next_token == 6
    logits[0] = 0
    logits[0, 3] = 1.0  # second child wins, it has no children
    logits[2, 5] = 1.0
    acceptance = verify_greedy(logits, TOKENS, TOPOLOGY)
    assert (acceptance.nodes, acceptance.next_token, acceptance.accepted_drafts) == ((0, 2), 5, 1)
    logits[0] = 0
    logits[0, 7] = 1.0  # nothing accepted: the base model's own token
    assert verify_greedy(logits, TOKENS, TOPOLOGY).nodes == (0,)
    assert verify_greedy(logits, TOKENS, TOPOLOGY).next_token == 7


def test_root_only_tree():
    topology = tree_topology([-1], pad_to_multiple=4)
    logits = torch.randn(4, 8)
    assert verify_greedy(logits, torch.tensor([1, 1, 1, 1]), topology).nodes == (0,)
    params = SamplingParams(temperature=1.0)
    assert verify_sampling(logits, torch.tensor([1, 1, 1, 1]), topology, params).nodes == (0,)


def test_sampling_params_validated():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"acceptance": "fast"}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams().greedy
    with pytest.raises(ValueError, match="temperature > 0"):
        target_probabilities(torch.zeros(4), SamplingParams())


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 5, 1.0), (1.3, 0, 0.8), (0.7, 20, 0.6)]
)
def test_target_probabilities_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = target_probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    torch.testing.assert_close(ours, torch.softmax(theirs, dim=-1))


def emitted_pairs(verifier, logits, samples: int):
    """Counts of the first emitted token, and of the second one after node 1's token was accepted."""
    first = torch.zeros(logits.shape[-1])
    second_after_child = torch.zeros(logits.shape[-1])
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    for _ in range(samples):
        acceptance = verifier(logits, TOKENS, TOPOLOGY, params, generator)
        emitted = TOKENS[list(acceptance.nodes[1:])].tolist() + [acceptance.next_token]
        first[emitted[0]] += 1
        if acceptance.nodes[1:2] == (1,):
            second_after_child[emitted[1]] += 1
    return first, second_after_child


def test_rejection_sampling_is_exact_at_every_node():
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)) * 1.5
    logits[0, 2] += 3.0  # make the first child likely, so its subtree is visited often
    first, second = emitted_pairs(verify_sampling, logits, samples=6000)
    root_p, child_p = torch.softmax(logits[0], -1), torch.softmax(logits[1], -1)
    assert chisquare(first.numpy(), (root_p * first.sum()).numpy()).pvalue > 1e-3
    assert chisquare(second.numpy(), (child_p * second.sum()).numpy()).pvalue > 1e-3
    assert second.sum() > 1000


def test_typical_acceptance_threshold():
    params = SamplingParams(temperature=1.0, acceptance="typical")
    logits = torch.full((4, 8), -10.0)
    logits[0, 2] = 5.0  # a confident root: p(2) ~ 1 > threshold
    logits[1, 5] = 5.0  # node 1 is confident in another token: its child gets p ~ 1e-7 < threshold
    acceptance = verify_typical(logits, TOKENS, TOPOLOGY, params, torch.Generator().manual_seed(0))
    assert acceptance.nodes == (0, 1)
    assert verify_tree(logits, TOKENS, TOPOLOGY, params, torch.Generator().manual_seed(0)).nodes == (0, 1)
    # at T = 0 typical acceptance is plain greedy
    assert verify_tree(logits, TOKENS, TOPOLOGY, SamplingParams(acceptance="typical")).nodes == (0, 1)
