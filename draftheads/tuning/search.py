"""Choosing the tree: expected tokens per step over measured cost, as pure functions.

A tree's expected tokens per step is 1 + the sum of its nodes' path probabilities (a node is accepted
iff its whole path is); expected speedup = that / (cost(N) + draft cost), in units of one plain
decoding step. Static trees (Medusa, MTP) grow greedily by the highest path probability (Cai et al.
2024, "Medusa", sec. 3.3.1, "optimal sparse tree"), every size is scored and the best kept; EAGLE
dynamic trees are a grid over (top_k, depth, total_tokens), each scored on the EAGLE-2 selection
simulated with the acceptance model standing in for the drafter's confidence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from draftheads.infer.tree import DynamicTree, StaticTree, padded_size
from draftheads.tuning.acceptance import AcceptanceModel


@dataclass(frozen=True)
class Candidate:
    """One scored tree: expected tokens per step over its cost, in plain decoding steps."""

    tree: StaticTree | DynamicTree
    nodes: int  # tree tokens verified, root included, before padding
    expected_tokens: float  # E[accepted drafts + 1] per step
    cost: float  # (verify(padded nodes) + draft) relative to one plain step
    expected_speedup: float


def greedy_static_trees(
    acceptance: AcceptanceModel, max_nodes: int
) -> list[tuple[tuple[tuple[int, ...], ...], float]]:
    """Medusa's sparse-tree construction (sec. 3.3.1): starting from the root, repeatedly add the
    candidate node with the highest path probability. Returns, for 1 .. max_nodes nodes (root
    included), the choices and the expected accepted drafts. A child's probability never exceeds
    its parent's, so every prefix of the sequence is a tree and is the best tree of its size."""
    heap: list[tuple[float, int, tuple[int, ...]]] = []

    def push_children(path: tuple[int, ...]) -> None:
        if len(path) < acceptance.depth:
            for rank in range(acceptance.top_k):
                child = (*path, rank)
                probability = acceptance.path_probability(child)
                if probability > 0:
                    heapq.heappush(heap, (-probability, len(child), child))

    push_children(())
    chosen: list[tuple[int, ...]] = []
    expected = 0.0
    trees = [((), 0.0)]
    while heap and len(chosen) + 1 < max_nodes:
        negative, _, path = heapq.heappop(heap)
        chosen.append(path)
        expected -= negative
        trees.append((tuple(chosen), expected))
        push_children(path)
    return trees


def choose_static_tree(
    acceptance: AcceptanceModel,
    verify_cost: Callable[[int], float],
    draft_cost: Callable[[StaticTree], float],
    max_nodes: int,
    pad_to_multiple: int = 1,
    name: str = "tuned",
) -> tuple[Candidate, list[Candidate]]:
    """Score the greedy tree of every size; return the best and all (by size)."""
    candidates = []
    for choices, expected in greedy_static_trees(acceptance, max_nodes):
        tree = StaticTree(f"{name}-{len(choices) + 1}", choices)
        cost = verify_cost(padded_size(tree.num_nodes, pad_to_multiple)) + draft_cost(tree)
        candidates.append(Candidate(tree, tree.num_nodes, 1 + expected, cost, (1 + expected) / cost))
    best = max(candidates, key=lambda c: (c.expected_speedup, -c.nodes))
    return best, candidates


def dynamic_proposals(acceptance: AcceptanceModel, top_k: int, depth: int) -> list[float]:
    """Path probabilities of every node EAGLE-2 proposes with (top_k, depth), the acceptance model
    standing in for the drafter's confidence (the EAGLE-2 premise, sec. 3): the root's top_k
    children, then at each depth the top_k of each of the top_k best frontier nodes."""
    frontier = [(acceptance.path_probability((r,)), (r,)) for r in range(top_k)]
    proposals = [p for p, _ in frontier]
    for _ in range(1, depth):
        layer = [
            (acceptance.path_probability((*path, r)), (*path, r))
            for _, path in frontier
            for r in range(top_k)
        ]
        proposals.extend(p for p, _ in layer)
        frontier = sorted(layer, key=lambda item: -item[0])[:top_k]
    return proposals


def choose_dynamic_tree(
    acceptance: AcceptanceModel,
    verify_cost: Callable[[int], float],
    draft_cost: Callable[[DynamicTree], float],
    max_top_k: int,
    max_depth: int,
    max_nodes: int,
    pad_to_multiple: int = 1,
    name: str = "tuned",
) -> tuple[Candidate, list[Candidate]]:
    """Grid over (top_k, depth, total_tokens); the kept nodes are the best total_tokens - 1 proposals.
    Drafting is timed once per (top_k, depth) at the largest total (selection cost grows with it)."""
    candidates = []
    for top_k in range(1, min(max_top_k, acceptance.top_k) + 1):
        for depth in range(1, min(max_depth, acceptance.depth) + 1):
            proposals = sorted(dynamic_proposals(acceptance, top_k, depth), reverse=True)
            largest = min(max_nodes, len(proposals) + 1)
            drafting = draft_cost(DynamicTree(f"{name}-k{top_k}-d{depth}", top_k, depth, largest))
            expected = 1.0
            for total in range(2, largest + 1):
                expected += proposals[total - 2]
                tree = DynamicTree(f"{name}-k{top_k}-d{depth}-n{total}", top_k, depth, total)
                cost = verify_cost(padded_size(total, pad_to_multiple)) + drafting
                candidates.append(Candidate(tree, total, expected, cost, expected / cost))
    best = max(candidates, key=lambda c: (c.expected_speedup, -c.nodes, -c.tree.depth))
    return best, candidates
