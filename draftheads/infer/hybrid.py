"""Hybrid drafting: a head's tree and the text's continuations (the context drafter's or the suffix
drafter's) merged into one tree, so a single verification forward accepts whichever source was
right (the "staged" combination of a learned drafter with an n-gram one; SuffixDecoding, Oliaro et
al. 2024, sec. 4, combines its suffix-tree drafts with a model's the same way).

Merging keeps one node per distinct path: a context continuation that follows a path the head
proposed shares its nodes, and only what the head did not propose is added. Children of a node
stay distinct tokens, which is all lossless verification needs (the acceptance rule never asks who
proposed a candidate; ``verify.py``). Every node keeps its sources for the statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.infer.context import ContextDrafter, ContextTree
from draftheads.infer.draft import Draft, Drafter, DraftSteps, DynamicTree, StaticTree, run_steps
from draftheads.infer.suffix import SuffixDrafter, SuffixTree
from draftheads.infer.tree import tree_topology

BOTH = "+"  # joins the sources of a node proposed by more than one


@dataclass(frozen=True)
class HybridTree:
    """A head's tree settings and the text drafter's (context or suffix drafts), drafted together
    each step."""

    head: StaticTree | DynamicTree | None  # None: the text drafts alone this step
    context: ContextTree | SuffixTree

    @property
    def name(self) -> str:
        return f"{self.head.name if self.head else 'no-head'}+{self.context.name}"

    @property
    def max_nodes(self) -> int:
        return (self.head.max_nodes if self.head is not None else 1) + self.context.max_nodes - 1

    def truncated(self, max_depth: int) -> HybridTree:
        head = self.head.truncated(max_depth) if self.head is not None else None
        return HybridTree(head, self.context.truncated(max_depth))

    def without_head(self) -> HybridTree:
        return HybridTree(None, self.context)


def _node_lists(draft: Draft) -> tuple[list[int], list[int], list[str], list[float]]:
    parents = list(draft.topology.parents[: draft.topology.num_nodes])
    return draft.tokens.tolist(), parents, list(draft.sources), list(draft.scores)


def merge_drafts(first: Draft, second: Draft, pad_to_multiple: int = 1) -> Draft:
    """One tree holding every path of ``first`` and of ``second`` (same root); ``first``'s nodes keep
    their indices and order, ``second``'s new nodes follow (parents before children)."""
    tokens, parents, sources, scores = _node_lists(first)
    if tokens[0] != int(second.tokens[0]):
        raise ValueError(f"drafts to merge must share the root, got {tokens[0]} and {int(second.tokens[0])}")
    child_of = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens)) if node}
    other_tokens, other_parents, other_sources, other_scores = _node_lists(second)
    merged = [0] + [0] * (len(other_tokens) - 1)  # second's node -> merged node
    for node in range(1, len(other_tokens)):
        parent = merged[other_parents[node]]
        key = (parent, other_tokens[node])
        if key in child_of:
            existing = child_of[key]
            if other_sources[node] not in sources[existing].split(BOTH):
                sources[existing] = f"{sources[existing]}{BOTH}{other_sources[node]}"
            scores[existing] = max(scores[existing], other_scores[node])
        else:
            existing = len(tokens)
            child_of[key] = existing
            tokens.append(other_tokens[node])
            parents.append(parent)
            sources.append(other_sources[node])
            scores.append(other_scores[node])
        merged[node] = existing
    return Draft(
        torch.tensor(tokens, dtype=torch.long, device=first.tokens.device),
        tree_topology(parents, pad_to_multiple),
        sources=tuple(sources),
        scores=tuple(scores),
    )


class HybridDrafter(Drafter):
    """A head's Drafter and a text drafter (by default a ``ContextDrafter``) proposing together; one
    merged tree per step."""

    def __init__(self, head_drafter: Drafter, context_drafter: ContextDrafter | SuffixDrafter | None = None):
        super().__init__(head_drafter.head, head_drafter.pad_to_multiple)
        self.head_drafter = head_drafter
        self.context_drafter = context_drafter or ContextDrafter(head_drafter.pad_to_multiple)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head_drafter.feature_layers

    @property
    def max_depth(self) -> int:
        return -1  # the context part is not bounded by the head's depth

    def select_features(self, hidden_states, index=None):
        return self.head_drafter.select_features(hidden_states, index)

    def check_tree(self, tree) -> None:
        if not isinstance(tree, HybridTree):
            raise TypeError(f"a hybrid drafter drafts a HybridTree, not '{getattr(tree, 'name', tree)}'")
        if tree.head is not None:
            self.head_drafter.check_tree(tree.head)
        self.context_drafter.check_tree(tree.context)

    def fork(self) -> Drafter:
        other = super().fork()
        other.head_drafter = self.head_drafter.fork()
        other.context_drafter = self.context_drafter.fork()
        return other

    def prefill(self, features, next_ids) -> None:
        self.head_drafter.prefill(features, next_ids)
        self.context_drafter.prefill(features, next_ids)

    def commit(self, features, next_ids, position) -> None:
        self.head_drafter.commit(features, next_ids, position)
        self.context_drafter.commit(features, next_ids, position)

    def flush(self) -> None:
        self.head_drafter.flush()

    def propose(self, root, position, tree) -> Draft:
        return run_steps(self.propose_steps(root, position, tree))

    def propose_steps(self, root, position, tree) -> DraftSteps:
        self.check_tree(tree)
        context_draft = self.context_drafter.propose(root, position, tree.context)
        if tree.head is None:  # the head sits this step out (adaptive drafting)
            return context_draft
        head_draft = yield from self.head_drafter.propose_steps(root, position, tree.head)
        return merge_drafts(head_draft, context_draft, self.pad_to_multiple)

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        return self.head_drafter.path_candidates(root, position, path, top_k)
