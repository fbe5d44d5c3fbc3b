"""Whether a decoding step drafts at all: the wall-clock check that keeps speculation from ever
costing more than it wins.

Adaptive drafting (``adaptive.py``) prunes each tree against the measured cost of verifying it, but
that cost curve leaves out what drafting itself costs: the head's forwards, its catching up on the
accepted tokens, the trees' bookkeeping. With one row those are small next to a verification
forward; with a batch they are not (the batch's forward is spread over its rows, the drafting
work grows with them) and once the batch saturates the machine's compute, speculation only adds
work (every token of a tree costs about what a row's plain step costs).

``StepGate`` therefore measures the outcome directly: tokens per second of decoding step, for
steps that drafted and for plain steps (the root alone, every row), per batch size, as
exponential moving averages. A plain step emits one token per row; a drafting step counts the
tokens it was expected to emit (1 + the calibrated path probabilities of its nodes, per row),
since the 1, 2 or 3 tokens one step happens to accept are too noisy to compare on: with a weak
head, a few unlucky steps would otherwise send the gate to plain steps for many steps. (The decode
loop counts a batch's drafting step as its rows times its least-advanced row's expected tokens:
the batch is done when its slowest row is; while prompts wait for a place, ``generate(...,
batch_size=B)``, as all its rows' expected tokens, since a finished row is replaced at once.)
It keeps the faster of the two and tries the other
every ``probe_every`` steps (less often the slower the other kind was), so it follows the text
(repetitive passages make drafting pay, then stop) and the batch (it shrinks as rows finish; each
size has its own measurements). A plain step is what the base model's own decoding does, so a
gated loop costs at most the probes over plain decoding.

A batch size not yet measured both ways borrows another's choice only where the cost of
verification makes it safe: drafting pays less the bigger the batch (a batched forward over B rows
of N tokens costs more relative to B rows of one as B grows, until every extra token costs what a
row's plain step does), so drafting that lost at a smaller batch loses at this one, and drafting
that won at a larger one wins here. A batch that lost a row or two also follows its near
neighbours (within a factor of 2). Anything else (drafting won with one row: does it with four?)
is measured: a few steps of each kind before the gate chooses.

A drafting step that follows plain steps (or the prefill) first lets the head catch up on every
token it has not seen: the prompt, or the tokens of the plain steps since it last drafted. That
step costs what switching to drafting costs once, not what steady drafting costs per step (timed,
it would make drafting look several times slower than plain steps), so the gate does not measure
it: the step after it drafts too and is measured in its place. A probe of drafting is therefore
two drafting steps, and its interval is set for two.

Expected tokens are calibrated probabilities, and the trees keep the nodes whose estimates
came out highest, so they run a little high (a winner's curse): the gate scales a drafting step's
expected tokens by what recent drafting steps emitted over what they were expected to. Recent,
and pulled towards 1 by a prior: the calibration it corrects learns within a few dozen steps (its
first context drafts are priced at the drafter's own score, before it has learnt anything), and a
ratio summed over every step since the start would keep those first errors for hundreds of steps
and hold the gate to plain steps where drafting pays. Its sums fade with every step, plain ones
included, so evidence that is old weighs as little in the correction as it does in the
calibration.

The figures behind these choices: docs/inference.md, "Drafting sources: a head, the context, both;
adaptive drafting".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """Exponential moving averages of the tokens and seconds of one kind of step."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def record(self, tokens: float, seconds: float, smoothing: float) -> None:
        if self.steps == 0:
            self.tokens, self.seconds = tokens, seconds
        else:
            self.tokens += smoothing * (tokens - self.tokens)
            self.seconds += smoothing * (seconds - self.seconds)
        self.steps += 1

    @property
    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class StepGate:
    """Decides, per step and batch size, whether the rows draft (True) or verify their roots alone.

    A batch size first drafts for ``warmup_steps`` steps, then steps plainly as long; from then on
    it keeps whichever emitted more tokens per second and runs one step of the other kind now and
    then to keep that estimate fresh: every ``probe_every`` steps, or less often when the other kind
    was much slower, so that probing costs at most ``probe_budget`` of the time (a probe of a kind
    r times slower costs r - 1 steps' worth per step it takes: a drafting probe takes two, the
    first of which catches the head up and is not measured), up to every ``max_probe_every`` steps.
    A batch size not yet measured both ways borrows another's choice where that is safe (the
    module's docstring says which), else warms up, measuring its own steps until it has both.
    """

    probe_every: int = 12
    max_probe_every: int = 256
    # The share of the time probes may cost. A drafting probe costs more than it is priced at (the
    # head catches up on the skipped tokens first), so the budget is kept well below the gap a
    # gated loop may open over plain batched decoding.
    probe_budget: float = 0.01
    # Steps of each kind before the first choice: one drafting step emits 1 to 9 tokens, so a
    # choice made on a few steps varies from run to run on the same prompt.
    warmup_steps: int = 8
    smoothing: float = 0.2
    measured: dict[tuple[int, bool], Throughput] = field(default_factory=dict)  # (batch, drafted) ->
    since_probe: dict[int, int] = field(default_factory=dict)  # batch -> steps since the last probe
    follow_up: set[int] = field(default_factory=set)  # batch sizes whose next step drafts, to be measured
    correction_prior: float = 32.0  # tokens of drafting that emitted what was expected, always counted
    correction_decay: float = 0.98  # per recorded step of either kind: about the last 50 steps count
    expected_tokens: float = 0.0  # over recent drafting steps (fading): the tokens expected of them ...
    emitted_tokens: float = 0.0  # ... and those they emitted

    @property
    def correction(self) -> float:
        """Emitted over expected tokens of recent drafting steps, with ``correction_prior`` tokens
        at a ratio of 1 (so 1 before any evidence, and again once the evidence has faded)."""
        expected = self.expected_tokens + self.correction_prior
        return (self.emitted_tokens + self.correction_prior) / expected if expected > 0 else 1.0

    def _arm(self, batch: int, drafted: bool) -> Throughput:
        return self.measured.setdefault((batch, drafted), Throughput())

    def _compare(self, batch: int) -> tuple[bool, float] | None:
        """(whether drafting is the faster kind, faster rate / slower rate) for ``batch``, once both
        kinds have ``warmup_steps`` steps measured; None before."""
        drafting, plain = self.measured.get((batch, True)), self.measured.get((batch, False))
        if drafting is None or plain is None or min(drafting.steps, plain.steps) < self.warmup_steps:
            return None
        drafting_rate = drafting.rate * self.correction
        faster, slower = max(drafting_rate, plain.rate), min(drafting_rate, plain.rate)
        ratio = faster / slower if slower > 0 else math.inf
        return drafting_rate > plain.rate, ratio

    def _decision(self, batch: int) -> tuple[bool, float] | None:
        """``_compare`` for ``batch``; else another batch size's where that is safe (the module's
        docstring), the nearest first; else None (``batch`` warms up)."""
        own = self._compare(batch)
        if own is not None:
            return own
        others = {b: self._compare(b) for b in {b for b, _ in self.measured} - {batch}}
        measured = {b: decision for b, decision in others.items() if decision is not None}
        safe = [
            b for b, (drafting_faster, _) in measured.items() if (b > batch) == drafting_faster
        ]  # drafting lost with fewer rows, or won with more
        near = [b for b in measured if batch / 2 <= b <= 2 * batch]
        for candidates in (safe, near):
            if candidates:
                return measured[min(candidates, key=lambda b: (abs(b - batch), b))]
        return None

    def probe_interval(self, ratio: float, probe_steps: int = 1) -> int:
        """Steps between probes of ``probe_steps`` steps of a kind ``ratio`` times slower than the
        kept one."""
        if not math.isfinite(ratio):
            return self.max_probe_every
        wanted = math.ceil(probe_steps * (ratio - 1.0) / self.probe_budget)
        return min(self.max_probe_every, max(self.probe_every, wanted))

    def drafts(self, batch: int) -> bool:
        """Whether a step of a ``batch``-row batch drafts."""
        if batch in self.follow_up:  # the last step caught the head up: measure the next one
            self.follow_up.discard(batch)
            return True
        decision = self._decision(batch)
        if decision is None:  # warm-up: draft, then step plainly
            return self._arm(batch, True).steps < self.warmup_steps
        drafting_faster, ratio = decision
        if self.since_probe.get(batch, 0) >= self.probe_interval(ratio, 1 if drafting_faster else 2):
            return not drafting_faster
        return drafting_faster

    def record(
        self,
        batch: int,
        drafted: bool,
        tokens: float,
        seconds: float,
        emitted: float | None = None,
        expected: float | None = None,
        catching_up: bool = False,
    ) -> None:
        """One step of a ``batch``-row batch: whether it drafted, the tokens it emitted (or was
        expected to) over all rows, and the seconds it took from drafting to the last row's
        bookkeeping. ``emitted``: for a drafting step weighed by expected ``tokens``, the tokens it
        did emit, and ``expected`` (default ``tokens``) the expectation to hold them against
        (together they correct the expectations: ``correction``). ``catching_up``: a drafting
        step whose head first caught up on tokens it had not seen (the prompt, or plain steps'):
        its time is not measured, and the next step of this batch size drafts in its place."""
        expected = tokens if expected is None else expected
        if seconds < 0 or min(tokens, expected, 0 if emitted is None else emitted) < 0:
            raise ValueError(
                f"a step emits tokens >= 0 in seconds >= 0, got {tokens} ({emitted} emitted) in {seconds}"
            )
        self.expected_tokens *= self.correction_decay
        self.emitted_tokens *= self.correction_decay
        if drafted and emitted is not None:
            self.expected_tokens += expected
            self.emitted_tokens += emitted
        decision = self._decision(batch)
        if drafted and catching_up:
            self.follow_up.add(batch)
        else:
            self._arm(batch, drafted).record(tokens, seconds, self.smoothing)
        if decision is not None and drafted != decision[0]:  # a probe of the other kind of step
            self.since_probe[batch] = 0
        else:
            self.since_probe[batch] = self.since_probe.get(batch, 0) + 1

    def summary(self) -> str:
        """The measured rates, one line per batch size (for logs and bench reports)."""
        lines = []
        for batch in sorted({b for b, _ in self.measured}):
            drafting = self.measured.get((batch, True), Throughput())
            plain = self.measured.get((batch, False), Throughput())
            lines.append(
                f"batch {batch}: drafting {drafting.rate * self.correction:.1f} tokens/s over "
                f"{drafting.steps} steps, plain {plain.rate:.1f} tokens/s over {plain.steps} steps"
            )
        if self.expected_tokens:
            lines.append(
                f"recent drafting steps emitted {self.emitted_tokens:.0f} tokens of "
                f"{self.expected_tokens:.1f} expected (rates scaled by {self.correction:.3f})"
            )
        return "\n".join(lines)
