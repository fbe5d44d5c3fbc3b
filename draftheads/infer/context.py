"""Context drafting: continuations of the longest recent n-gram match in the prompt and the text
generated so far, with no model at all.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; in transformers
as ``prompt_lookup_num_tokens``) drafts the one continuation that follows the first earlier
occurrence of the last n tokens. SuffixDecoding (Oliaro et al. 2024, arXiv:2411.04975) keeps every
continuation in a suffix tree, ranks them by how often they occurred, and drafts a tree of them
(``suffix.py``, which also matches earlier answers); text that repeats itself (code, edits, agentic
loops) is where context drafts beat learned ones.
Here: find the longest suffix of the sequence, between ``max_ngram`` and ``min_ngram`` tokens, that
occurred before; take the continuations after each earlier occurrence; merge them into a trie
counting how many occurrences share each path; keep the best-supported nodes. A node's score is the
share of occurrences that continue through it, the drafter's own estimate of its path probability.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from draftheads.infer.draft import Draft, Drafter
from draftheads.infer.tree import ROOT_PARENT, tree_topology


class TextTreeSize:
    """What the settings of a tree drafted from text share (``ContextTree``, ``suffix.SuffixTree``):
    ``depth``, ``total_tokens`` and ``max_matches``, checked alike, and truncation to a depth limit."""

    kind: ClassVar[str]  # in messages: "context", "suffix"

    def check_size(self) -> None:
        if self.depth < 0 or self.total_tokens < 1 or self.max_matches < 1:
            raise ValueError(
                f"{self.kind} tree '{self.name}': depth, total_tokens and max_matches must be positive"
            )

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    def truncated(self, max_depth: int):
        """The same settings with depth at most ``max_depth`` (negative: no limit)."""
        if max_depth < 0 or self.depth <= max_depth:
            return self
        return replace(self, depth=max_depth)


@dataclass(frozen=True)
class ContextTree(TextTreeSize):
    """Settings of a context-drafted tree (its shape follows the text, not a fixed pattern)."""

    kind: ClassVar[str] = "context"
    name: str = "context"
    max_ngram: int = 4  # longest suffix matched against the earlier text
    min_ngram: int = 1  # shortest suffix that may still propose
    depth: int = 8  # longest continuation drafted
    total_tokens: int = 16  # tree size, root included
    max_matches: int = 32  # most recent earlier occurrences considered

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"context tree: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            )
        self.check_size()


@dataclass(frozen=True)
class Continuations:
    """A trie of continuations after the root: node i > 0 has ``tokens[i]``, ``parents[i]``
    (ROOT_PARENT for children of the root, else an earlier index) and ``scores[i]`` in (0, 1]."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    scores: tuple[float, ...]


EMPTY = Continuations((), (), ())


def match_continuations(sequence: torch.Tensor, tree: ContextTree) -> list[list[int]]:
    """Continuations (each up to ``tree.depth`` tokens, most recent occurrence first) that follow
    earlier occurrences of the longest suffix of ``sequence`` (1-D ids) with a match."""
    length = sequence.shape[0]
    for n in range(min(tree.max_ngram, length - 1), tree.min_ngram - 1, -1):
        windows = sequence[: length - 1].unfold(
            0, n, 1
        )  # (length - n, n): starts whose end precedes the suffix
        hits = (windows == sequence[length - n :]).all(dim=1).nonzero().flatten()  # (M,)
        if hits.numel():
            starts = (hits + n).flip(0)[: tree.max_matches].tolist()  # continuation starts, newest first
            return [sequence[start : start + tree.depth].tolist() for start in starts]
    return []


def support_trie(
    continuations: list[list[int]], max_nodes: int, total: int, min_support: int = 1
) -> Continuations:
    """Merge continuations into a trie and keep its ``max_nodes`` best-supported nodes with support
    at least ``min_support`` (a node's support, the continuations through it, never exceeds its
    parent's, so the kept nodes form a tree; ties go to the node seen first); a node's score is its
    support / ``total``."""
    children: dict[tuple[int, int], int] = {}  # (trie parent, token) -> trie node
    tokens, parents, counts = [], [], []
    for continuation in continuations:
        node = ROOT_PARENT
        for token in continuation:
            key = (node, token)
            if key not in children:
                children[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
                counts.append(0)
            node = children[key]
            counts[node] += 1
    supported = [i for i in range(len(tokens)) if counts[i] >= min_support]
    kept = sorted(sorted(supported, key=lambda i: -counts[i])[: max(max_nodes, 0)])  # trie order
    index = {node: i for i, node in enumerate(kept)}
    return Continuations(
        tuple(tokens[n] for n in kept),
        tuple(ROOT_PARENT if parents[n] == ROOT_PARENT else index[parents[n]] for n in kept),
        tuple(counts[n] / total for n in kept),
    )


def continuation_trie(continuations: list[list[int]], tree: ContextTree) -> Continuations:
    """Merge continuations into a trie and keep the ``tree.total_tokens - 1`` best-supported nodes
    (ties go to the node seen first, i.e. the more recent occurrence); a node's score is the share
    of continuations through it."""
    if not continuations or tree.total_tokens < 2 or tree.depth == 0:
        return EMPTY
    return support_trie(continuations, tree.total_tokens - 1, len(continuations))


def context_draft(sequence: torch.Tensor, tree: ContextTree) -> Continuations:
    """The context-drafted trie after ``sequence`` (1-D ids ending with the root)."""
    return continuation_trie(match_continuations(sequence, tree), tree)


def path_children(continuations: list[list[int]], path: list[int], top_k: int) -> list[list[int]]:
    """For each depth d = 1 .. len(path) + 1: the ``top_k`` tokens most often following the root
    and ``path[:d - 1]`` among ``continuations`` (most frequent first, -1 where fewer exist)."""
    rows = []
    alive = continuations
    for depth in range(len(path) + 1):
        counts: dict[int, int] = {}
        for continuation in alive:
            if len(continuation) > depth:
                counts[continuation[depth]] = counts.get(continuation[depth], 0) + 1
        best = sorted(counts, key=lambda token: -counts[token])[:top_k]  # stable: recency breaks ties
        rows.append(best + [-1] * (top_k - len(best)))
        if depth < len(path):
            alive = [c for c in alive if len(c) > depth and c[depth] == path[depth]]
    return rows


def trie_draft(root: int, trie: Continuations, source: str, pad_to_multiple: int = 1) -> Draft:
    """The Draft of ``root`` with ``trie`` below it, every node proposed by ``source``."""
    parents = [ROOT_PARENT] + [0 if p == ROOT_PARENT else p + 1 for p in trie.parents]
    return Draft(
        torch.tensor([root, *trie.tokens], dtype=torch.long),
        tree_topology(parents, pad_to_multiple),
        sources=("",) + (source,) * len(trie.tokens),
        scores=(1.0, *trie.scores),
    )


class ContextDrafter(Drafter):
    """Drafts from the text alone (see the module docstring); needs no head and no features.

    Args:
        pad_to_multiple: pad each proposed tree to a multiple of this many tokens.
    """

    source = "context"

    def __init__(self, pad_to_multiple: int = 1):
        super().__init__(None, pad_to_multiple)
        self.sequence: list[int] = []  # the committed text: prompt (from position 1) and accepted tokens

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def max_depth(self) -> int:
        return -1

    def select_features(self, hidden_states, index=None):
        return None

    def check_tree(self, tree) -> None:
        if not isinstance(tree, ContextTree):
            raise TypeError(f"a context drafter drafts a ContextTree, not '{getattr(tree, 'name', tree)}'")

    def fork(self) -> Drafter:
        other = copy.copy(self)
        other.sequence = list(self.sequence)
        return other

    def prefill(self, features, next_ids) -> None:
        self.sequence = next_ids[0].tolist()

    def commit(self, features, next_ids, position) -> None:
        self.sequence.extend(next_ids[0].tolist())

    def propose(self, root, position, tree) -> Draft:
        self.check_tree(tree)
        trie = context_draft(torch.tensor(self.sequence, dtype=torch.long), tree)
        return trie_draft(root, trie, self.source, self.pad_to_multiple)

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        tree = ContextTree(depth=len(path) + 1)
        continuations = match_continuations(torch.tensor(self.sequence, dtype=torch.long), tree)
        return torch.tensor(path_children(continuations, path.tolist(), top_k), dtype=torch.long)
