"""What verifying a tree of N tokens costs on this machine: measured once, used to decide how big a
tree pays (``tune-tree`` chooses a tree with it; adaptive drafting prunes each step's tree with it).

cost(N) = one base forward verifying N tree tokens after a prefix (mask, checks and cache
compaction included), relative to N = 1, median over interleaved repeats, made non-decreasing.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftheads.infer.cache import crop_to_lengths, keep_accepted_rows
from draftheads.infer.forward import rows_forward
from draftheads.infer.tree import read_tuned_entry, tree_topology, tuned_tree_key
from draftheads.timing import synchronize


def isotonic(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a bigger
    tree never costs less, so a dip is noise, and one slow outlier must not lift every later size."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


@functools.lru_cache(maxsize=256)
def _isotonic(values: tuple[float, ...]) -> tuple[float, ...]:
    """``isotonic``, remembered: adaptive drafting reads the same curve many times a step."""
    return tuple(isotonic(values))


@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one verification forward of N tree tokens. ``relative(n)`` interpolates
    linearly over the isotonic fit of the medians, relative to the fitted N = 1."""

    sizes: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]

    def fitted(self) -> list[float]:
        return list(_isotonic(self.seconds))

    def relative(self, size: int) -> float:
        fit = self.fitted()
        base = fit[0]
        if size <= self.sizes[0] or len(self.sizes) == 1:
            return fit[0] / base
        points = list(zip(self.sizes, fit))
        for (n0, c0), (n1, c1) in itertools.pairwise(points):
            if size <= n1:
                return (c0 + (c1 - c0) * (size - n0) / (n1 - n0)) / base
        (n0, c0), (n1, c1) = points[-2:]  # beyond the largest size: extend the last segment
        return (c1 + (c1 - c0) * (size - n1) / (n1 - n0)) / base

    def speedup_bound(self, tau: float) -> float:
        """The most a head with mean accepted length ``tau`` (tokens per step, the base's own token
        included) can gain here: its trees need at least ceil(tau) nodes, since a step accepts no
        more drafts than the tree is deep, and drafting is taken as free."""
        return tau / self.relative(math.ceil(tau - 1e-9))

    def ceiling(self) -> tuple[float, int]:
        """(speedup, N): the most any head could gain here. A head whose every draft is accepted
        emits N tokens per N-token chain; drafting for free, a step costs ``relative(N)`` plain
        steps, so no head beats max_N N / relative(N) on this machine and dtype."""
        speedup, size = max((size / self.relative(size), -size) for size in self.sizes)  # ties: fewer
        return speedup, -size


@torch.inference_mode()
def measure_verify_cost(
    model,
    cache,
    root: int,
    sizes: Sequence[int],
    repeats: int,
    feature_layers=(),
    progress: bool = False,
    slots: torch.Tensor | None = None,
) -> CostCurve:
    """Median seconds of verifying N tokens (forward + cache compaction) after what ``cache`` holds,
    sizes interleaved; the cache is left as it was. ``slots``: for a batch cache, the (B, L) bool
    slots holding each row's entries (``rows_forward``); then every row verifies N tokens, so the
    curve is what one batched step costs with trees of N nodes in every row."""
    from tqdm.auto import tqdm

    past = cache.get_seq_length()
    if slots is None:
        slots = torch.ones(1, past, dtype=torch.bool)
    batch = slots.shape[0]
    device = model.device
    topologies = {n: tree_topology([-1] + list(range(n - 1))) for n in sizes}  # chains: cost is the size
    tokens = torch.full((max(sizes),), root, dtype=torch.long)
    first = torch.zeros(1, dtype=torch.long, device=device)

    def verify(n: int) -> None:
        rows_forward(model, cache, [tokens[:n]] * batch, [topologies[n]] * batch, slots, feature_layers)
        keep_accepted_rows(cache, slots, [first] * batch)  # as a step that accepts none
        crop_to_lengths([cache], [past])

    for n in sizes:  # warm-up: kernels and allocator for every shape
        verify(n)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    bar = tqdm(total=repeats * len(sizes), desc="verify cost", unit="fwd", disable=not progress)
    for _ in range(repeats):
        for n in sizes:
            synchronize(device)
            started = time.perf_counter()
            verify(n)
            synchronize(device)
            samples[n].append(time.perf_counter() - started)
            bar.update()
    bar.close()
    return CostCurve(tuple(sizes), tuple(statistics.median(samples[n]) for n in sizes))


# ---- curves measured by ``draftheads tune-tree``, saved with the head ----------------------------


def costs_to_dict(costs: dict[int, CostCurve]) -> dict:
    """``{batch: {"sizes", "seconds"}}`` (JSON keys are strings)."""
    return {str(b): {"sizes": list(c.sizes), "seconds": list(c.seconds)} for b, c in sorted(costs.items())}


def same_machine(recorded: dict) -> bool:
    """Whether a recorded ``machine_info`` is this machine as far as speed goes: the CPU model, its
    vector extensions and the thread count (a curve from another machine would mislead)."""
    from draftheads.machine import cpu_flags, cpu_name

    return (
        recorded.get("cpu") == cpu_name()
        and recorded.get("cpu_flags") == cpu_flags()
        and recorded.get("cpu_threads") == torch.get_num_threads()
    )


def load_tuned_costs(path, dtype, device) -> dict[int, CostCurve]:
    """The verify-cost curves by batch size that ``draftheads tune-tree`` measured for this device
    and dtype, if it measured them on this machine (``same_machine``); else none (adaptive drafting
    then measures at the first call)."""
    from draftheads.heads.base import HeadFormatError  # lazily: this module needs no transformers

    found = read_tuned_entry(path, dtype, device)
    if found is None:
        return {}
    path, entry = found
    where = f"{path}: trees.{tuned_tree_key(dtype, device)}"
    machine, verify_costs = entry.get("machine"), entry.get("verify_costs")
    for field_name, value in (("machine", machine), ("verify_costs", verify_costs)):
        if value is not None and not isinstance(value, dict):
            raise HeadFormatError(f"{where}.{field_name}: must be a JSON object, got {value!r:.80}")
    if verify_costs is None or not same_machine(machine or {}):
        return {}
    costs = {}
    for batch, curve in verify_costs.items():
        try:
            costs[int(batch)] = CostCurve(
                tuple(int(n) for n in curve["sizes"]), tuple(float(t) for t in curve["seconds"])
            )
        except (KeyError, TypeError, ValueError) as err:
            raise HeadFormatError(f"{where}.verify_costs.{batch}: {err!r}") from err
    return costs
