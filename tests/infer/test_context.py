"""Context drafting and hybrid trees as pure functions: n-gram matches, the continuation trie, and
merging a head's tree with context continuations."""

from __future__ import annotations

import pytest
import torch

from draftheads.infer.context import (
    ContextDrafter,
    ContextTree,
    continuation_trie,
    match_continuations,
    path_children,
)
from draftheads.infer.draft import Draft
from draftheads.infer.hybrid import merge_drafts
from draftheads.infer.tree import ROOT_PARENT, tree_topology

SEQUENCE = torch.tensor([1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 1, 2, 3])


def test_longest_suffix_with_an_earlier_match_wins_newest_first():
    continuations = match_continuations(SEQUENCE, ContextTree(max_ngram=4, depth=3))
    assert continuations == [[7, 6, 5], [9, 8, 1]]  # after "1 2 3" at 5 and at 0; "5 1 2 3" never before
    assert match_continuations(torch.tensor([4, 5, 6]), ContextTree()) == []
    # the suffix itself is not an earlier occurrence, and a match at the very end has no continuation
    assert match_continuations(torch.tensor([5, 5]), ContextTree(max_ngram=1, depth=2)) == [[5]]


def test_trie_keeps_the_best_supported_nodes_as_a_tree():
    continuations = [[4, 5, 6], [4, 5, 7], [4, 8], [9]]
    trie = continuation_trie(continuations, ContextTree(total_tokens=5))
    # 4 (3/4), 5 (2/4), then four nodes of support 1/4: the first two seen (6, 7) are kept
    assert trie.tokens == (4, 5, 6, 7)
    assert trie.parents == (ROOT_PARENT, 0, 1, 1)
    assert trie.scores == (0.75, 0.5, 0.25, 0.25)
    assert continuation_trie([], ContextTree()).tokens == ()
    assert continuation_trie(continuations, ContextTree(total_tokens=1)).tokens == ()


def test_path_children_ranks_by_frequency_along_a_path():
    continuations = [[4, 5, 6], [4, 5, 7], [4, 8], [9]]
    assert path_children(continuations, [4, 5], 2) == [[4, 9], [5, 8], [6, 7]]
    assert path_children(continuations, [9], 2) == [[4, 9], [-1, -1]]


def test_context_drafter_proposes_a_padded_tree_from_its_text():
    drafter = ContextDrafter(pad_to_multiple=4)
    drafter.prefill(None, SEQUENCE[None, :-1])
    drafter.commit(None, SEQUENCE[None, -1:], SEQUENCE.shape[0])
    draft = drafter.propose(3, SEQUENCE.shape[0], ContextTree(depth=2, total_tokens=8))
    assert draft.tokens.tolist() == [3, 7, 6, 9, 8]
    assert draft.topology.parents[:5] == (ROOT_PARENT, 0, 1, 0, 3)
    assert draft.topology.size == 8 and draft.sources == ("", *["context"] * 4)
    with pytest.raises(TypeError, match="ContextTree"):
        drafter.propose(3, 0, "cpu-8")


def _draft(tokens, parents, source):
    scores = tuple(1.0 / (1 + i) for i in range(len(tokens)))
    return Draft(torch.tensor(tokens), tree_topology(parents), ("",) + (source,) * (len(tokens) - 1), scores)


def test_merge_shares_common_paths_and_appends_the_rest():
    head = _draft([0, 10, 11, 12], [ROOT_PARENT, 0, 0, 1], "eagle")  # 10 -> 12, and 11
    context = _draft([0, 10, 12, 13, 14], [ROOT_PARENT, 0, 1, 2, 0], "context")  # 10 -> 12 -> 13, and 14
    merged = merge_drafts(head, context, pad_to_multiple=4)
    assert merged.tokens.tolist() == [0, 10, 11, 12, 13, 14]
    assert merged.topology.parents[:6] == (ROOT_PARENT, 0, 0, 1, 3, 0)
    assert merged.sources == ("", "eagle+context", "eagle", "eagle+context", "context", "context")
    assert merged.scores[1] == 1.0 / 2 and merged.scores[4] == 1.0 / 4
    assert merged.topology.size == 8 and merged.topology.num_nodes == 6
    for node in range(1, 6):  # children of a node are distinct tokens
        siblings = [merged.tokens[c].item() for c in merged.topology.children[merged.topology.parents[node]]]
        assert len(siblings) == len(set(siblings))
    with pytest.raises(ValueError, match="share the root"):
        merge_drafts(head, _draft([1], [ROOT_PARENT], "context"))
