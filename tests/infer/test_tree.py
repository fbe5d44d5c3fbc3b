"""Tree topologies, masks, retrieve paths and KV compaction: unit tests and hypothesis properties
over random trees and random accepted paths."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from draftheads.infer.cache import cache_lengths, crop_to_lengths, keep_accepted
from draftheads.infer.tree import (
    MC_SIM_7B_63,
    PATH_PAD,
    TREES,
    DynamicTree,
    StaticTree,
    padded_size,
    resolve_tree,
    select_dynamic_nodes,
    tree_attention_mask,
    tree_position_ids,
    tree_topology,
)
from draftheads.infer.verify import verify_greedy

# ---- unit tests ---------------------------------------------------------------------------------


def test_static_tree_from_choices():
    tree = StaticTree("t", ((1,), (0,), (0, 0), (1, 0), (0, 1)))
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.parents == (-1, 0, 0, 1, 1, 2)
    assert tree.ranks == (0, 0, 1, 0, 1, 0)
    assert (tree.depth, tree.top_k(1), tree.top_k(2)) == (2, 2, 2)
    topology = tree.topology()
    assert topology.retrieve_paths.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    assert topology.children == ((1, 2), (3, 4), (5,), (), (), ())


def test_named_trees():
    assert StaticTree("m", MC_SIM_7B_63).num_nodes == 64 and TREES["mc_sim_7b_63"].depth == 4
    assert TREES["eagle1-26"].num_nodes == 26 and TREES["eagle1-26"].depth == 5
    assert TREES["cpu-8"].num_nodes == 8 and TREES["cpu-16"].num_nodes == 16
    assert resolve_tree([[0], [0, 0]]).num_nodes == 3
    with pytest.raises(ValueError, match="unknown tree 'nope'; known trees: chain-2"):
        resolve_tree("nope")


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match=r"path \[0, 1\] has no parent path \[0\]"):
        StaticTree("bad", ((1,), (0, 1)))
    with pytest.raises(ValueError, match="duplicate"):
        StaticTree("bad", ((0,), (0,)))
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        DynamicTree("bad", top_k=0, depth=2, total_tokens=4)


def test_truncated():
    tree = TREES["mc_sim_7b_63"].truncated(2)
    assert tree.depth == 2 and all(len(p) <= 2 for p in tree.choices)
    assert TREES["dynamic-gpu"].truncated(3).depth == 3
    assert TREES["cpu-8"].truncated(-1) is TREES["cpu-8"]


def test_padding_nodes_are_isolated():
    topology = tree_topology([-1, 0, 0, 1, 1], pad_to_multiple=4)
    assert (topology.size, topology.num_nodes) == (8, 5)
    padding = slice(5, 8)
    assert torch.equal(topology.ancestor_mask[padding], torch.eye(8, dtype=torch.bool)[padding])
    assert not topology.ancestor_mask[:5, padding].any()
    assert all(not c for c in topology.children[padding])
    assert int(topology.retrieve_paths.max()) < 5
    assert topology.pad_tokens(torch.tensor([7, 1, 2, 3, 4])).tolist() == [7, 1, 2, 3, 4, 7, 7, 7]


def test_a_root_only_tree_is_never_padded():
    """One token is plain decoding (a GEMV); padding it to 4 would make it cost a 4-token forward."""
    assert tree_topology([-1], pad_to_multiple=4).size == 1
    assert [padded_size(n, 4) for n in (1, 2, 4, 5)] == [1, 4, 4, 8]
    assert [padded_size(n, 1) for n in (1, 2, 3)] == [1, 2, 3]


def test_mask_layout_and_dtype():
    topology = tree_topology([-1, 0, 1, 0])
    mask = tree_attention_mask(topology, past_length=3, dtype=torch.bfloat16, batch_size=2)
    assert mask.shape == (2, 1, 4, 7) and mask.dtype == torch.bfloat16
    attend = mask[0, 0] == 0
    assert attend[:, :3].all()
    assert attend[:, 3:].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, False, False, True],
    ]
    assert (mask[0, 0][~attend] == torch.finfo(torch.bfloat16).min).all()
    assert tree_position_ids(topology, 3).tolist() == [[3, 4, 5, 4]]
    with pytest.raises(ValueError, match="floating"):
        tree_attention_mask(topology, 3, torch.bool)


def test_select_dynamic_nodes_keeps_best_connected():
    # proposals: a(-1) b(-1) | a1(a) a2(a) b1(b)
    scores = torch.tensor([-0.1, -2.0, -0.5, -0.3, -2.1])
    parents = [-1, -1, 0, 0, 1]
    assert select_dynamic_nodes(scores, parents, total_tokens=4) == [0, 2, 3]
    assert select_dynamic_nodes(scores, parents, total_tokens=100) == [0, 1, 2, 3, 4]
    # ties and -inf never drop a kept node's ancestor
    tied = torch.tensor([0.0, float("-inf"), 0.0, float("-inf"), float("-inf")])
    assert select_dynamic_nodes(tied, [-1, -1, 0, 1, 3], total_tokens=4) == [0, 1, 2]


# ---- properties over random trees ---------------------------------------------------------------


@st.composite
def random_trees(draw):
    size = draw(st.integers(min_value=1, max_value=24))
    parents = [-1] + [draw(st.integers(min_value=0, max_value=node - 1)) for node in range(1, size)]
    pad = draw(st.sampled_from([1, 4, 8]))
    return parents, pad


def chain_of(parents, node):
    chain = [node]
    while parents[chain[-1]] != -1:
        chain.append(parents[chain[-1]])
    return chain[::-1]


@settings(max_examples=150, deadline=None)
@given(random_trees(), st.integers(min_value=0, max_value=12))
def test_topology_properties(tree, past):
    parents, pad = tree
    topology = tree_topology(parents, pad)
    count = len(parents)
    assert topology.size == padded_size(count, pad) and topology.num_nodes == count
    assert topology.size % pad == 0 or count == 1  # a root-only tree is never padded
    for node in range(count):
        chain = chain_of(parents, node)
        assert topology.ancestor_mask[node, :count].nonzero().flatten().tolist() == chain
        assert int(topology.depths[node]) == len(chain) - 1
    # one retrieve path per leaf, root..leaf, padded with PATH_PAD; together they cover every node
    leaves = [n for n in range(count) if n not in parents[1:]]
    paths = topology.retrieve_paths.tolist()
    assert sorted(max(p) for p in paths) == leaves
    covered = set()
    for path in paths:
        real = [n for n in path if n != PATH_PAD]
        assert path == real + [PATH_PAD] * (len(path) - len(real))
        assert real == chain_of(parents, real[-1])
        covered.update(real)
    assert covered == set(range(count))
    mask = tree_attention_mask(topology, past, torch.float32)[0, 0]
    assert (mask[:, :past] == 0).all()
    assert torch.equal(mask[:, past:] == 0, topology.ancestor_mask)
    positions = tree_position_ids(topology, past)[0]
    assert torch.equal(positions[:count], past + topology.depths[:count])


@settings(max_examples=150, deadline=None)
@given(random_trees(), st.data())
def test_greedy_accepts_the_planted_path(tree, data):
    """Plant a path: tokens per node distinct among siblings; logits at each path node point at the
    next path node's token, and at the path end at a token no child has. Greedy must accept exactly it."""
    parents, pad = tree
    topology = tree_topology(parents, pad)
    count, vocab = len(parents), 64
    target = data.draw(st.integers(min_value=0, max_value=count - 1))
    path = chain_of(parents, target)
    tokens = torch.tensor([3 + node for node in range(count)])  # distinct everywhere
    padded = topology.pad_tokens(tokens)
    logits = torch.randn(topology.size, vocab, generator=torch.Generator().manual_seed(count))
    for parent, child in itertools.pairwise(path):
        logits[parent, padded[child]] = 100.0
    logits[path[-1], 1] = 100.0  # token 1 is nobody's: the path ends here
    acceptance = verify_greedy(logits, padded, topology)
    assert acceptance.nodes == tuple(path)
    assert acceptance.next_token == 1


def fake_cache(layers: int, length: int) -> DynamicCache:
    """A cache whose entry i holds the value i everywhere (keys) and -i (values)."""
    cache = DynamicCache()
    index = torch.arange(length, dtype=torch.float32)[None, None, :, None].expand(1, 2, length, 3)
    for layer in range(layers):
        cache.update(index.clone(), -index.clone(), layer)
    return cache


@settings(max_examples=150, deadline=None)
@given(random_trees(), st.integers(min_value=0, max_value=10), st.data())
def test_keep_accepted_compacts_the_cache(tree, past, data):
    parents, pad = tree
    topology = tree_topology(parents, pad)
    target = data.draw(st.integers(min_value=0, max_value=len(parents) - 1))
    path = torch.tensor(chain_of(parents, target))
    cache = fake_cache(layers=2, length=past + topology.size)
    keep_accepted(cache, past, path)
    expected = torch.cat([torch.arange(past), past + path]).float()
    assert cache.get_seq_length() == past + len(path)
    for layer in cache.layers:
        assert torch.equal(layer.keys[0, 1, :, 0], expected)
        assert torch.equal(layer.values[0, 0, :, 2], -expected)


def test_crop_to_lengths_rolls_back_each_cache():
    caches = [fake_cache(1, 5), fake_cache(2, 3)]
    lengths = cache_lengths(caches)
    for cache in caches:
        for layer in range(len(cache.layers)):
            cache.update(torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3), layer)
    crop_to_lengths(caches, lengths)
    assert cache_lengths(caches) == (5, 3)
    with pytest.raises(ValueError, match="expected 2 cache lengths"):
        crop_to_lengths(caches, (1,))
