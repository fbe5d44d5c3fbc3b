"""Suffix drafting: continuations of the longest patterns of the text that occurred before, in this
request or in earlier answers, scored by how often they occurred, in a tree as large as the match
is long (SuffixDecoding; Oliaro et al. 2024, arXiv:2411.04975).

The paper keeps a suffix tree per request (its prompt and output so far) and a global one over the
outputs of earlier requests; Arctic Inference (github.com/snowflakedb/ArcticInference, the
implementation behind vLLM's ``suffix`` method) drafts from each and keeps the better-scoring
draft. Here the text (prompt and answer so far) and a ``SuffixHistory`` of earlier answers (bounded
in tokens, the oldest dropped first; ``SpeculativeGenerator`` keeps one across calls) are one pool
of occurrences, so a pattern seen in both counts the evidence of both. For the pattern of the
text's last m tokens:

- its occurrences are the places it ended before: in the text, and in each stored answer (never
  across two sequences);
- the tokens after each occurrence (until its sequence ends) merge into a trie; a node's count is
  the occurrences that continue through it, its score the product of count(child) / count(parent)
  along its path, that is count / (occurrences + 1): the pattern's own count includes the current
  occurrence, whose continuation is not known yet (Arctic Inference's trees, which hold the text
  itself, count it the same way);
- its tree has at most min(total_tokens - 1, alpha * m) nodes (the paper's MAX_SPEC = alpha * p, p
  the pattern length: a longer match earns a longer speculation), the best-scoring first (a child
  never scores above its parent, so they form a tree), none scoring below ``min_score``;
- a tree scores the sum of its nodes' scores (the tokens it would add if scores were acceptance
  probabilities); of the pattern lengths from ``min_pattern`` to ``max_pattern``, the one whose
  tree scores highest drafts, ties going to the longer (Arctic Inference's choice).

Only the lengths at which the set of occurrences changes need a tree (between two of them the tree
is the same, only allowed fewer nodes), and a length whose tree size cannot beat the best score so
far (n nodes score below n) ends the search. The occurrences are the ``max_matches`` with the
longest matches, then the most recent, which bounds the Python work per step.

The index is a flat array of token ids: the stored answers and then the text, each followed by a
separator that matches nothing. A step scans it for the text's last token with one vectorised
comparison, then compares the occurrences backwards along the pattern all at once (those whose
previous token differs, most of them, first dropped). The scan is O(stored tokens), but at well
under a nanosecond a token: a whole step, most of it the trie's Python, takes 0.1-0.3 ms with up to
16,384 stored tokens beside a 1,000-token text, about what the context drafter takes
(docs/inference.md). A suffix tree would find the match in O(pattern length), but kept in Python
it costs more at these sizes: each appended token updates up to ``max_pattern`` nodes (Arctic
Inference's tree, in C++, walks them all), some 64 dictionary operations where one vectorised scan
covers a few thousand tokens, and dropping the oldest answer means removing each of its suffixes
from the tree; here it is dropping a slice.
"""

from __future__ import annotations

import copy
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from draftheads.infer.context import (
    EMPTY,
    Continuations,
    TextTreeSize,
    path_children,
    support_trie,
    trie_draft,
)
from draftheads.infer.draft import Draft, Drafter
from draftheads.infer.tree import ROOT_PARENT

SEPARATOR = -1  # after every sequence in the index: equal to no token, it ends matches and continuations


@dataclass(frozen=True)
class SuffixTree(TextTreeSize):
    """Settings of a suffix-drafted tree, as ``ContextTree`` holds a context-drafted one's (the index
    behind it is a flat array, not the paper's suffix tree: see the module docstring)."""

    kind: ClassVar[str] = "suffix"
    name: str = "suffix"
    max_pattern: int = 64  # longest pattern matched (Arctic Inference's default tree depth)
    min_pattern: int = 1  # shortest pattern that may still propose
    alpha: float = 1.0  # nodes per matched token, MAX_SPEC = alpha * m (vLLM's default max_spec_factor)
    min_score: float = 0.1  # no node scoring below this is drafted (vLLM's default min_token_prob)
    depth: int = 15  # longest continuation drafted: a chain as long as the whole tree
    total_tokens: int = 16  # tree size, root included
    max_matches: int = 32  # occurrences considered: the longest matches, then the most recent

    def __post_init__(self):
        if not 1 <= self.min_pattern <= self.max_pattern:
            raise ValueError(
                f"suffix tree: need 1 <= min_pattern <= max_pattern, got {self.min_pattern}, "
                f"{self.max_pattern}"
            )
        if not self.alpha > 0 or not 0 <= self.min_score <= 1:
            raise ValueError(
                f"suffix tree: need alpha > 0 and 0 <= min_score <= 1, got {self.alpha}, {self.min_score}"
            )
        self.check_size()

    def size(self, pattern_length: int) -> int:
        """The draft nodes a match of ``pattern_length`` tokens may propose."""
        return max(0, min(self.total_tokens - 1, math.floor(self.alpha * pattern_length + 1e-9)))

    def min_support(self, occurrences: int) -> int:
        """The fewest continuations a node needs to score ``min_score`` among ``occurrences``."""
        return max(1, math.ceil(self.min_score * (occurrences + 1) - 1e-9))


# ---- what is matched: earlier answers and the text ----------------------------------------------


@dataclass(eq=False)  # state, compared by identity (its answers are arrays)
class SuffixHistory:
    """Earlier answers (token ids), oldest first, that suffix drafting matches besides the text; once
    they hold more than ``max_tokens`` tokens the oldest are dropped (0: none are kept)."""

    max_tokens: int = 16384
    answers: deque = field(default_factory=deque)  # (n_i,) int64 arrays
    stored: int = 0  # tokens in ``answers``
    _flat: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError(f"suffix history: max_tokens must be >= 0, got {self.max_tokens}")

    def add(self, tokens: Sequence[int]) -> None:
        """Store one answer (at most its last ``max_tokens`` tokens); drop the oldest beyond the bound."""
        if self.max_tokens == 0:
            return
        answer = np.asarray(tokens, dtype=np.int64).reshape(-1)[-self.max_tokens :]
        if answer.size == 0:
            return
        self.answers.append(answer)
        self.stored += answer.size
        while self.stored > self.max_tokens:
            self.stored -= self.answers.popleft().size
        self._flat = None

    def clear(self) -> None:
        self.answers.clear()
        self.stored = 0
        self._flat = None

    def flat(self) -> np.ndarray:
        """(stored + answers,) every answer followed by ``SEPARATOR``, oldest first."""
        if self._flat is None:
            separator = np.array([SEPARATOR], dtype=np.int64)
            pieces = [piece for answer in self.answers for piece in (answer, separator)]
            self._flat = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        return self._flat


@dataclass(eq=False)
class SuffixCorpus:
    """What one sequence drafts from, in one array: a separator, the stored answers, then its text
    (from ``text_start`` to ``length``); every entry past ``length`` is a separator too."""

    tokens: np.ndarray  # (capacity,) int64, capacity > length
    length: int
    text_start: int

    @classmethod
    def of(cls, stored: np.ndarray, text: Sequence[int]) -> SuffixCorpus:
        """The corpus of ``stored`` answers (``SuffixHistory.flat``) and a text."""
        start = 1 + stored.size
        corpus = cls(np.full(start + len(text) + 1, SEPARATOR, dtype=np.int64), start, start)
        corpus.tokens[1:start] = stored
        corpus.extend(text)
        return corpus

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the text."""
        needed = self.length + len(tokens) + 1  # a separator stays after the end
        if needed > self.tokens.size:
            grown = np.full(2 * needed, SEPARATOR, dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : self.length + len(tokens)] = tokens
        self.length += len(tokens)

    def copy(self) -> SuffixCorpus:
        return SuffixCorpus(self.tokens.copy(), self.length, self.text_start)


# ---- the rules, as pure functions ---------------------------------------------------------------


def occurrences(corpus: SuffixCorpus, max_pattern: int) -> tuple[np.ndarray, np.ndarray]:
    """Where the text's last token occurred before (its own place excluded): (k,) positions in
    ``corpus.tokens``, and at each how many of the text's last tokens (up to ``max_pattern``) end
    there, the match length."""
    tokens, end = corpus.tokens, corpus.length - 1
    if end < corpus.text_start:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(tokens[:end] == tokens[end])  # (k,), all > 0: tokens[0] is a separator
    lengths = np.ones(ends.size, dtype=np.int64)  # (k,)
    pattern_length = min(max_pattern, corpus.length - corpus.text_start)
    if pattern_length < 2 or ends.size == 0:
        return ends, lengths
    longer = np.flatnonzero(tokens[ends - 1] == tokens[end - 1])  # most occurrences stop here
    offsets = np.arange(pattern_length)  # (P,)
    pattern = tokens[end - offsets]  # (P,) the text's last tokens, newest first
    # indices before the array clip to its first entry, a separator
    agree = np.take(tokens, ends[longer, None] - offsets, mode="clip") == pattern  # (k', P)
    lengths[longer] = np.where(agree.all(axis=1), pattern_length, agree.argmin(axis=1))
    return ends, lengths


def ranked_occurrences(corpus: SuffixCorpus, tree: SuffixTree) -> tuple[np.ndarray, np.ndarray]:
    """The ``tree.max_matches`` occurrences of at least ``tree.min_pattern`` tokens with the longest
    matches, then the most recent: (k,) positions and (k,) match lengths, longest first."""
    ends, lengths = occurrences(corpus, tree.max_pattern)
    order = np.lexsort((-ends, -lengths))[: tree.max_matches]  # by length, then position, descending
    ends, lengths = ends[order], lengths[order]
    kept = int(np.count_nonzero(lengths >= tree.min_pattern))  # a prefix: sorted by length
    return ends[:kept], lengths[:kept]


def continuations_after(corpus: SuffixCorpus, ends: np.ndarray, depths: Sequence[int]) -> list[list[int]]:
    """The tokens after each position of ``ends``: up to ``depths[i]`` of them, fewer where the
    sequence holding it ends."""
    if ends.size == 0:
        return []
    offsets = np.arange(1, max(depths) + 1)  # (D,)
    # indices past the array clip to its last entry, a separator
    window = np.take(corpus.tokens, ends[:, None] + offsets, mode="clip").tolist()  # (k, D)
    continuations = []
    for row, depth in zip(window, depths):
        row = row[:depth]
        continuations.append(row[: row.index(SEPARATOR)] if SEPARATOR in row else row)
    return continuations


def _count_path(continuation: list[int], children: dict, supports: list[int], with_support: Counter) -> None:
    """Add one continuation to a trie: ``children`` (parent, token) -> node, each node's support,
    and how many nodes have each support."""
    node = ROOT_PARENT
    for token in continuation:
        child = children.get((node, token))
        if child is None:
            child = children[(node, token)] = len(supports)
            supports.append(0)
        else:
            with_support[supports[child]] -= 1
        supports[child] += 1
        with_support[supports[child]] += 1
        node = child


def _best_supports(with_support: Counter, size: int, least: int, most: int) -> int:
    """The sum of the ``size`` largest supports of at least ``least`` (none exceeds ``most``)."""
    total, remaining = 0, size
    for support in range(most, least - 1, -1):
        taken = min(with_support.get(support, 0), remaining)
        total += taken * support
        remaining -= taken
        if remaining == 0:
            break
    return total


def choose_pattern(
    continuations: list[list[int]], lengths: Sequence[int], tree: SuffixTree
) -> tuple[int, int]:
    """The pattern length whose tree scores highest (ties: the longer) and its occurrences, the
    first of ``continuations`` (sorted by match length ``lengths``, longest first); (0, 0) when no
    tree has a node. Each continuation must hold what its own match may draft, no less."""
    children: dict[tuple[int, int], int] = {}
    supports: list[int] = []
    with_support: Counter = Counter()
    best, best_score, counted = (0, 0), 0.0, 0
    for pattern_length in sorted(set(lengths), reverse=True):
        size = tree.size(pattern_length)
        if size <= best_score:  # every node scores below 1: this size and smaller cannot win
            break
        while counted < len(lengths) and lengths[counted] >= pattern_length:
            _count_path(continuations[counted], children, supports, with_support)
            counted += 1
        least = tree.min_support(counted)
        # the `size` best-supported nodes form a tree, deeper nodes never among them
        score = _best_supports(with_support, size, least, counted) / (counted + 1)
        if score > best_score:
            best, best_score = (pattern_length, counted), score
    return best


def suffix_draft(corpus: SuffixCorpus, tree: SuffixTree) -> Continuations:
    """The suffix-drafted trie after the corpus's text (see the module docstring)."""
    ends, lengths = ranked_occurrences(corpus, tree)
    lengths = lengths.tolist()
    continuations = continuations_after(corpus, ends, [min(tree.depth, tree.size(m)) for m in lengths])
    pattern_length, count = choose_pattern(continuations, lengths, tree)
    if count == 0:
        return EMPTY
    size = tree.size(pattern_length)
    chosen = [continuation[:size] for continuation in continuations[:count]]
    return support_trie(chosen, size, count + 1, tree.min_support(count))


# ---- the drafter --------------------------------------------------------------------------------


class SuffixDrafter(Drafter):
    """Drafts from the text and the earlier answers in ``history`` (see the module docstring); needs
    no head and no features. The history is read once per sequence, at its start.

    Args:
        history: the earlier answers to match besides the text; None: the text alone.
        pad_to_multiple: pad each proposed tree to a multiple of this many tokens.
    """

    source = "suffix"

    def __init__(self, history: SuffixHistory | None = None, pad_to_multiple: int = 1):
        super().__init__(None, pad_to_multiple)
        self.history = history
        self.corpus = SuffixCorpus.of(np.empty(0, dtype=np.int64), [])

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def max_depth(self) -> int:
        return -1

    def select_features(self, hidden_states, index=None):
        return None

    def check_tree(self, tree) -> None:
        if not isinstance(tree, SuffixTree):
            raise TypeError(f"a suffix drafter drafts a SuffixTree, not '{getattr(tree, 'name', tree)}'")

    def fork(self) -> Drafter:
        other = copy.copy(self)
        other.corpus = self.corpus.copy()
        return other

    def prefill(self, features, next_ids) -> None:
        stored = self.history.flat() if self.history is not None else np.empty(0, dtype=np.int64)
        self.corpus = SuffixCorpus.of(stored, next_ids[0].tolist())

    def commit(self, features, next_ids, position) -> None:
        self.corpus.extend(next_ids[0].tolist())

    def propose(self, root, position, tree) -> Draft:
        self.check_tree(tree)
        return trie_draft(root, suffix_draft(self.corpus, tree), self.source, self.pad_to_multiple)

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        ends, lengths = ranked_occurrences(self.corpus, SuffixTree())
        longest = ends[lengths == lengths[0]] if ends.size else ends
        continuations = continuations_after(self.corpus, longest, [len(path) + 1] * longest.size)
        return torch.tensor(path_children(continuations, path.tolist(), top_k), dtype=torch.long)
