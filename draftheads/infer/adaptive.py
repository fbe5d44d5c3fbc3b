"""Adaptive drafting: each step verifies only the draft nodes whose expected gain pays for what
verifying them costs here, and a head whose drafting costs more than it wins sits steps out.

A node's expected gain is the probability that its whole path is accepted. Drafters give their own
estimate (a head: its path probability; the context drafter: the share of earlier occurrences that
continue that way); ``Calibration`` maps (source, estimate) to the rate at which the verifier
actually accepted such nodes, learned online (draft confidence is a good predictor of acceptance:
Li et al. 2024, "EAGLE-2", sec. 3; SpecDec++, Huang et al. 2024, stops drafting on a predicted
acceptance threshold). ``select_nodes`` then keeps the best-first subtree that maximises expected
tokens per step over the step's cost: the measured cost of verifying it (``infer/verify_cost.py``) plus
the time already spent drafting it; when nothing pays, the step verifies the root alone, which is
exactly a plain decoding step.

A head's drafting time is spent before its tree can be pruned, so ``HeadGate`` also decides,
from online measurements, whether the head drafts at all this step: it stays in while the share of
the tokens per step it gets accepted exceeds the share of step time its drafting takes, and while
out it is probed every ``probe_every`` steps. An autoregressive head catches up on the skipped steps
in one call when it next drafts (``AutoregressiveDrafter.flush``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftheads.infer.draft import Draft, Drafter, DraftSteps, root_only, run_steps
from draftheads.infer.hybrid import HybridTree
from draftheads.infer.tree import ROOT_PARENT, padded_size, tree_topology
from draftheads.infer.verify_cost import CostCurve

# ---- calibration --------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Online P(node accepted | its source, its drafter score): per source, scores binned by powers
    of two (1 .. 1/2, 1/2 .. 1/4, ...), each bin a count of proposed and accepted nodes that decays
    (recent steps weigh more) and starts from ``prior`` pseudo-nodes accepted at the score itself."""

    bins: int = 12
    prior: float = 4.0
    decay: float = 0.995  # per recorded step
    table: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # key -> [proposed, accepted]

    def _key(self, source: str, score: float) -> tuple[str, int]:
        if not score > 0:
            return source, self.bins - 1
        return source, min(self.bins - 1, int(-math.log2(min(score, 1.0))))

    def probability(self, source: str, score: float) -> float:
        proposed, accepted = self.table.get(self._key(source, score), (0.0, 0.0))
        prior_score = score if score > 0 else 0.0
        return (accepted + self.prior * prior_score) / (proposed + self.prior)

    def path_probabilities(self, draft: Draft) -> list[float]:
        """``draft``'s real nodes' probabilities (root first, 1.0), a child never above its parent."""
        parents = list(draft.topology.parents[: draft.topology.num_nodes])
        return monotone(
            parents,
            [1.0] + [self.probability(draft.sources[n], draft.scores[n]) for n in range(1, len(parents))],
        )

    def record(self, sources: Sequence[str], scores: Sequence[float], accepted_nodes: Sequence[int]) -> None:
        """One verified step: ``sources`` / ``scores`` per node (root first), the accepted nodes."""
        for entry in self.table.values():
            entry[0] *= self.decay
            entry[1] *= self.decay
        accepted = set(accepted_nodes)
        for node in range(1, len(sources)):
            entry = self.table.setdefault(self._key(sources[node], scores[node]), [0.0, 0.0])
            entry[0] += 1.0
            entry[1] += float(node in accepted)


# ---- choosing the nodes to verify ---------------------------------------------------------------


def monotone(parents: Sequence[int], probabilities: Sequence[float]) -> list[float]:
    """Path probabilities: a node is accepted only with its parent, so it never counts as likelier
    (parents come before children)."""
    effective = list(probabilities)
    effective[0] = 1.0
    for node in range(1, len(parents)):
        effective[node] = min(effective[node], effective[parents[node]])
    return effective


def select_nodes(
    parents: Sequence[int],
    probabilities: Sequence[float],
    relative_cost: Callable[[int], float],
    pad_to_multiple: int = 1,
) -> list[int]:
    """The nodes to verify (ascending, root first): grown best-first by acceptance probability (a
    child never counts as likelier than its parent), every size scored as (1 + sum of kept
    probabilities) / relative_cost(padded size), the best size kept (ties: the smaller tree)."""
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
    effective = [1.0] + [0.0] * (len(parents) - 1)
    frontier: list[tuple[float, int]] = []

    def push_children(node: int) -> None:
        for child in children.get(node, ()):
            effective[child] = min(probabilities[child], effective[node])
            heapq.heappush(frontier, (-effective[child], child))

    push_children(0)
    kept, expected = [0], 1.0
    best_score, best_size = 1.0 / relative_cost(1), 1
    while frontier:
        _, node = heapq.heappop(frontier)
        kept.append(node)
        expected += effective[node]
        score = expected / relative_cost(padded_size(len(kept), pad_to_multiple))
        if score > best_score + 1e-12:
            best_score, best_size = score, len(kept)
        push_children(node)
    return sorted(kept[:best_size])


def prune_draft(draft: Draft, kept: Sequence[int], pad_to_multiple: int = 1) -> Draft:
    """The draft restricted to ``kept`` (ascending, root first, closed under parents)."""
    if len(kept) == draft.topology.num_nodes:
        return draft
    index = {node: i for i, node in enumerate(kept)}
    parents = [ROOT_PARENT] + [index[draft.topology.parents[node]] for node in kept[1:]]
    return Draft(
        draft.tokens[list(kept)],
        tree_topology(parents, pad_to_multiple),
        tuple(draft.sources[n] for n in kept),
        tuple(draft.scores[n] for n in kept),
    )


def common_tree_size(
    probabilities: Sequence[Sequence[float]], relative_cost: Callable[[int], float], pad_to_multiple: int = 1
) -> int:
    """One tree size for every row of a batch step (rows' trees are padded to the largest, so one
    row's big tree costs every row): the N maximising the batch's expected tokens, each row keeping
    its N - 1 likeliest nodes, over ``relative_cost`` of a batched step with N tokens per row.

    ``probabilities``: per row, the path probabilities of its non-root nodes. Ties: the smaller N."""
    ranked = [sorted(row, reverse=True) for row in probabilities]
    largest = 1 + max((len(row) for row in ranked), default=0)
    best_score, best_size, expected = -1.0, 1, float(len(ranked))
    for size in range(1, largest + 1):
        if size > 1:
            expected += sum(row[size - 2] for row in ranked if len(row) >= size - 1)
        score = expected / relative_cost(padded_size(size, pad_to_multiple))
        if score > best_score + 1e-12:
            best_score, best_size = score, size
    return best_size


def likeliest_nodes(probabilities: Sequence[float], size: int) -> list[int]:
    """The root and the ``size - 1`` likeliest nodes, ascending (``probabilities``: path
    probabilities of every node, root first, never above a parent's: a closed subtree)."""
    order = sorted(range(1, len(probabilities)), key=lambda n: (-probabilities[n], n))
    return [0, *sorted(order[: size - 1])]


def keep_likeliest(
    draft: Draft, probabilities: Sequence[float], size: int, pad_to_multiple: int = 1
) -> Draft:
    """``draft`` cut to ``likeliest_nodes(probabilities, size)``."""
    return prune_draft(draft, likeliest_nodes(probabilities, size), pad_to_multiple)


# ---- whether the head drafts --------------------------------------------------------------------


@dataclass
class HeadGate:
    """Keeps a head drafting while (the tokens per step only its nodes are expected to add) /
    (expected tokens per step) exceeds (its drafting seconds per step) / (seconds per step), all
    exponential moving averages; a head that is out drafts again now and then to refresh the
    estimate: every ``probe_every`` steps, or less often when drafting costs a larger share of a
    step, so that probes cost at most ``probe_budget`` of the time, up to every
    ``max_probe_every`` steps. Expected values (calibrated probabilities of the verified nodes) are
    far less noisy than the 0, 1 or 2 tokens one step happens to accept. The decode loop carries
    one gate from a sequence to the next, so its warm-up is paid once."""

    source: str
    probe_every: int = 16
    max_probe_every: int = 64
    probe_budget: float = 0.02
    warmup_steps: int = 4  # steps the head always drafts before the first decision
    smoothing: float = 0.1
    accepted: float = 0.0  # EMA of the tokens per step only the head's nodes are expected to add
    tokens: float = 1.0  # EMA of expected tokens per step
    seconds_with: float = 0.0  # EMA of propose seconds when the head drafted
    seconds_without: float = 0.0  # ... and when it did not
    step_seconds: float = 0.0  # EMA of seconds between proposals
    steps_with: int = 0
    steps_out: int = 0

    def _average(self, old: float, new: float, first: bool, weight: float | None = None) -> float:
        return new if first else old + (self.smoothing if weight is None else weight) * (new - old)

    def share_of_time(self) -> float:
        """The share of a step's time the head's drafting adds."""
        return max(self.seconds_with - self.seconds_without, 0.0) / self.step_seconds

    def probe_interval(self) -> int:
        """Steps out between probes: a probe costs ``share_of_time`` of a step."""
        wanted = math.ceil(self.share_of_time() / self.probe_budget)
        return min(self.max_probe_every, max(self.probe_every, wanted))

    def head_drafts(self) -> bool:
        if self.steps_with < self.warmup_steps or self.step_seconds <= 0:
            return True
        if self.steps_out >= self.probe_interval():
            return True
        return self.accepted / max(self.tokens, 1e-9) > self.share_of_time()

    def record(
        self,
        drafted: bool,
        propose_seconds: float,
        step_seconds: float | None,
        head_accepted: float,
        tokens: float,
    ) -> None:
        """One step: did the head draft, how long proposing took, the time since the previous
        proposal, the tokens expected from the head's own nodes and from the whole step."""
        if step_seconds is not None:
            self.step_seconds = self._average(self.step_seconds, step_seconds, self.step_seconds <= 0)
        self.tokens = self._average(self.tokens, tokens, False)
        if drafted:
            first = self.steps_with == 0
            # A probe after k steps out is the only news of those steps: it weighs what k + 1
            # updates would have (an estimate that moved 10% per probe kept a head out for good).
            weight = 1.0 - (1.0 - self.smoothing) ** (self.steps_out + 1)
            self.accepted = self._average(self.accepted, head_accepted, first, weight)
            self.seconds_with = self._average(self.seconds_with, propose_seconds, first, weight)
            self.steps_with += 1
            self.steps_out = 0
        else:
            self.seconds_without = self._average(self.seconds_without, propose_seconds, self.steps_out == 0)
            self.steps_out += 1


# ---- the drafter --------------------------------------------------------------------------------


class AdaptiveDrafter(Drafter):
    """Wraps a Drafter (a head's, the context's, or a hybrid): prunes every proposed tree to the
    nodes that pay (``select_nodes`` on calibrated probabilities and the measured ``cost``) and,
    when the inner drafter has a head, lets ``HeadGate`` decide whether it drafts each step.

    Args:
        inner: the Drafter whose trees are pruned.
        cost: the verify-cost curve of this machine, model and dtype (``infer/verify_cost.py``).
        calibration, gate: explicit state, fresh by default (one per sequence, or shared to carry
            what was learned from one sequence to the next).
        confidence: a learned acceptance head (``draftheads.infer.confidence.ConfidenceHead``) that
            prices the nodes in place of ``calibration``; None: the calibration does.
    """

    def __init__(
        self,
        inner: Drafter,
        cost: CostCurve,
        calibration: Calibration | None = None,
        gate: HeadGate | None = None,
        confidence=None,
    ):
        super().__init__(inner.head, inner.pad_to_multiple)
        self.inner = inner
        self.cost = cost
        self.calibration = calibration or Calibration()
        self.confidence = confidence
        self.gate = gate if gate is not None else (HeadGate(inner.source) if inner.head is not None else None)
        self._last: tuple[bool, float] | None = None  # the unrecorded proposal: head drafted, seconds
        self._last_started: float | None = None  # when the previous proposal began
        self._step_seconds: float | None = None  # between the last two proposals
        self._expected = (0.0, 1.0)  # tokens the last tree was expected to add: the head's alone, all
        self._priced: tuple[Draft, list[float]] | None = None  # the last pruned tree, its nodes' prices

    @property
    def source(self) -> str:
        return self.inner.source

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.inner.feature_layers

    @property
    def max_depth(self) -> int:
        return self.inner.max_depth

    def select_features(self, hidden_states, index: torch.Tensor | None = None):
        return self.inner.select_features(hidden_states, index)

    def check_tree(self, tree) -> None:
        self.inner.check_tree(tree)

    def fork(self) -> Drafter:
        other = super().fork()
        other.inner = self.inner.fork()
        return other

    def prefill(self, features, next_ids) -> None:
        self.inner.prefill(features, next_ids)
        self._last = self._last_started = None

    def commit(self, features, next_ids, position) -> None:
        self.inner.commit(features, next_ids, position)

    def flush(self) -> None:
        self.inner.flush()

    def propose(self, root, position, tree) -> Draft:
        return run_steps(self.propose_steps(root, position, tree))

    def propose_steps(self, root, position, tree) -> DraftSteps:
        started = time.perf_counter()
        head_drafts = self.gate is None or self.gate.head_drafts()
        if head_drafts:
            draft = yield from self.inner.propose_steps(root, position, tree)
        elif isinstance(tree, HybridTree):
            draft = yield from self.inner.propose_steps(root, position, tree.without_head())
        else:
            draft = root_only(root)
        parents = list(draft.topology.parents[: draft.topology.num_nodes])
        probabilities = self.path_probabilities(draft)
        # The drafting time is spent whatever is kept, so a step costs drafting + verification:
        # nodes are weighed against that (pricing them against verification alone made every node
        # look dearer than it is, and trees were cut smaller than paid).
        drafted = (time.perf_counter() - started) / self.cost.fitted()[0]  # in 1-token verifications
        kept = select_nodes(
            parents, probabilities, lambda size: self.cost.relative(size) + drafted, self.pad_to_multiple
        )
        pruned = prune_draft(draft, kept, self.pad_to_multiple)
        self._priced = (pruned, [probabilities[n] for n in kept])
        own = self.gate.source if self.gate is not None else None
        self._expected = (
            sum(probabilities[n] for n in kept[1:] if draft.sources[n] == own),  # the head's alone
            1.0 + sum(probabilities[n] for n in kept[1:]),
        )
        self._last = (head_drafts, time.perf_counter() - started)
        previous, self._last_started = self._last_started, started
        self._step_seconds = started - previous if previous is not None else None
        return pruned

    def path_probabilities(self, draft: Draft) -> list[float]:
        """Calibrated path probabilities of ``draft``'s real nodes (root first, 1.0): the confidence
        head's where there is one.

        For the tree this drafter last returned, the prices it was pruned by, read from the whole
        tree as drafted: a node's chance of acceptance does not depend on which of its siblings
        are verified, while the confidence head's sibling ranks would shift in the pruned tree
        (and pricing it again would cost a second pass)."""
        if self._priced is not None and draft is self._priced[0]:
            return list(self._priced[1])
        if self.confidence is not None:
            return self.confidence.path_probabilities(draft)
        return self.calibration.path_probabilities(draft)

    def record(self, draft: Draft, accepted_nodes: tuple[int, ...]) -> None:
        self.calibration.record(draft.sources, draft.scores, accepted_nodes)
        if self.gate is None:
            return
        if self._last is None:  # a plain step: nothing proposed; the next gap between proposals spans it
            self._last_started = None
            return
        head_drafted, propose_seconds = self._last
        self._last = None
        self.gate.record(head_drafted, propose_seconds, self._step_seconds, *self._expected)

    def path_candidates(self, root, position, path, top_k) -> torch.Tensor:
        return self.inner.path_candidates(root, position, path, top_k)
