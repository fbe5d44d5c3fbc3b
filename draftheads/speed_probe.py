"""How fast the machine is right now, measured the way plain decoding spends its time.

On a shared host another tenant's load comes and goes, and it does not slow every method alike:
plain decoding streams every weight once per token and is bound by memory bandwidth, while a
speculative step verifies several tokens per weight read and leans more on compute. A speedup
measured through a slow spell is therefore off, in a direction that depends on what the neighbour
loads, even with the methods interleaved. ``draftheads bench`` times a one-token forward of the
base (this module) between the methods' runs; each repeat of a batch of prompts (every method's
run of it, back to back) counts the slowest probe around it, repeats within ``QUIET_MARGIN`` of the
run's fastest are "quiet", and the speedup over those alone is what the machine gives undisturbed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from draftheads.timing import synchronize

QUIET_MARGIN = 0.05  # a repeat is quiet when its probe took at most 5% over the run's fastest
PROBE_RUNS = 3  # forwards per probe; the fastest counts (one hiccup is not a slow spell)
# The machine was busy while probes were taken when their median is this much over the fastest, or
# any one probe is BUSY_SLOWEST times it: a timing comparison made then says nothing.
BUSY_MEDIAN = 1.2
BUSY_SLOWEST = 2.0


def forward_seconds(model: torch.nn.Module, ids: torch.Tensor, runs: int = PROBE_RUNS) -> float:
    """The fastest of ``runs`` forwards of ``ids`` (1, T) through ``model``, no cache kept: with one
    token, plain decoding's unit of work (every weight read once)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    ids = ids.to(model.device)
    fastest = float("inf")
    with torch.inference_mode():
        for _ in range(runs):
            synchronize(ids.device)
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            synchronize(ids.device)  # a GPU runs the forward after the call returns
            fastest = min(fastest, time.perf_counter() - started)
    return fastest


@dataclass(frozen=True)
class ProbeSummary:
    fastest: float  # seconds
    median: float
    slowest: float
    quiet: int  # probes within QUIET_MARGIN of the fastest
    count: int

    @property
    def quiet_limit(self) -> float:
        return quiet_limit(self.fastest)

    def describe(self) -> str:
        return (
            f"fastest {1e3 * self.fastest:.2f} ms, median {1e3 * self.median:.2f} ms, slowest "
            f"{1e3 * self.slowest:.2f} ms; {self.quiet} of {self.count} within {QUIET_MARGIN:.0%} "
            "of the fastest"
        )


def quiet_limit(fastest: float) -> float:
    """The slowest probe that still counts as quiet."""
    return fastest * (1 + QUIET_MARGIN)


def summarize_probes(seconds: list[float]) -> ProbeSummary | None:
    if not seconds:
        return None
    fastest = min(seconds)
    return ProbeSummary(
        fastest,
        statistics.median(seconds),
        max(seconds),
        sum(s <= quiet_limit(fastest) for s in seconds),
        len(seconds),
    )


def machine_busy(seconds: list[float]) -> bool:
    """Whether probes taken through a measurement say the machine was busy (``BUSY_MEDIAN``,
    ``BUSY_SLOWEST``); False for fewer than two probes (nothing to compare)."""
    if len(seconds) < 2:
        return False
    fastest = min(seconds)
    return statistics.median(seconds) > BUSY_MEDIAN * fastest or max(seconds) > BUSY_SLOWEST * fastest
