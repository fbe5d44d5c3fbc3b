"""What one decoding step costs on this machine, measured with the real code.

cost(N) = one base forward verifying N tree tokens after a prefix (mask, checks and cache compaction
included), relative to N = 1, median over interleaved repeats; plus the time the head's Drafter
needs to propose a given tree and to commit a step's accepted tokens.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from draftheads.infer.cache import crop_to_lengths, keep_accepted, new_cache
from draftheads.infer.draft import drafter_for
from draftheads.infer.generate import tree_forward
from draftheads.infer.tree import DynamicTree, StaticTree, tree_topology


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


@dataclass(frozen=True)
class CostCurve:
    """Measured seconds of one verification forward of N tree tokens. ``relative(n)`` interpolates
    linearly over the isotonic fit of the medians, relative to the fitted N = 1."""

    sizes: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]

    def fitted(self) -> list[float]:
        return isotonic(self.seconds)

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


def cost_sizes(max_nodes: int, pad_to_multiple: int) -> list[int]:
    """Tree sizes to time: 1, then every padded size up to ``max_nodes`` (or a spread without padding)."""
    if pad_to_multiple > 1:
        sizes = range(pad_to_multiple, max_nodes + pad_to_multiple, pad_to_multiple)
    else:
        sizes = [
            n for n in (2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64) if n < max_nodes
        ]
        sizes = [*sizes, max_nodes]
    return sorted({1, *sizes})


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DecodingBench:
    """The state of a decoder after a prefix (base cache, root token, drafter), to time one step's
    pieces with the real code: verification forwards and the Drafter's ``propose`` and ``commit``."""

    @torch.no_grad()
    def __init__(self, model, head, prefix: torch.Tensor, pad_to_multiple: int, repeats: int):
        self.model, self.head, self.repeats = model, head, repeats
        self.device = model.device
        self.drafter = drafter_for(head, pad_to_multiple)
        ids = prefix[None].to(self.device)  # (1, T)
        self.cache = new_cache(model)
        output = model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=list(self.drafter.feature_layers),
        )
        self.past = ids.shape[1]
        self.root = int(output.logits[0, -1].argmax())
        features = self.drafter.select_features(output.hidden_states)  # (1, T, F)
        next_ids = torch.cat([ids[:, 1:], ids.new_tensor([[self.root]])], dim=1)  # (1, T)
        self.drafter.prefill(features, next_ids)
        self.commit_seconds = self._commit_seconds(features[:, -3:])
        self._draft_seconds: dict[object, float] = {}

    def _median(self, action: Callable[[], None]) -> float:
        times = []
        for _ in range(self.repeats):
            _synchronize(self.device)
            started = time.perf_counter()
            action()
            _synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def _commit_seconds(self, features: torch.Tensor) -> float:
        """Median seconds of one step's ``commit`` (a typical step accepts ~3 tokens), each run on a
        fork of the drafter: committing moves state that a rollback would not undo (MTP)."""
        count = features.shape[1]
        ids = torch.full((1, count), self.root, dtype=torch.long, device=self.device)
        times = []
        for _ in range(self.repeats + 1):  # the first is a warm-up
            drafter = self.drafter.fork()
            _synchronize(self.device)
            started = time.perf_counter()
            drafter.commit(features, ids, self.past)
            _synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    @torch.no_grad()
    def verify_cost(self, sizes: Sequence[int], progress: bool = True) -> CostCurve:
        """Median seconds of verifying N tokens (forward + cache compaction), sizes interleaved."""
        from tqdm.auto import tqdm

        topologies = {n: tree_topology([-1] + list(range(n - 1))) for n in sizes}  # chains: cost is the size
        tokens = torch.full((max(sizes),), self.root, dtype=torch.long)
        first = torch.zeros(1, dtype=torch.long, device=self.device)

        def verify(n: int) -> None:
            tree_forward(self.model, self.cache, tokens[:n], topologies[n], self.drafter.feature_layers)
            keep_accepted(self.cache, self.past, first)  # keep one entry, as a step that accepts none
            crop_to_lengths([self.cache], [self.past])

        for n in sizes:  # warm-up: kernels and allocator for every shape
            verify(n)
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        bar = tqdm(total=self.repeats * len(sizes), desc="verify cost", unit="fwd", disable=not progress)
        for _ in range(self.repeats):
            for n in sizes:
                _synchronize(self.device)
                started = time.perf_counter()
                verify(n)
                _synchronize(self.device)
                samples[n].append(time.perf_counter() - started)
                bar.update()
        bar.close()
        return CostCurve(tuple(sizes), tuple(statistics.median(samples[n]) for n in sizes))

    @torch.no_grad()
    def draft_seconds(self, tree: StaticTree | DynamicTree) -> float:
        """Median seconds the drafter needs for one step with ``tree``: ``propose`` (which rolls its
        own writes back) plus the step's ``commit`` of the accepted tokens; memoised by tree shape."""
        key = tree.choices if isinstance(tree, StaticTree) else (tree.top_k, tree.depth, tree.total_tokens)
        if key not in self._draft_seconds:

            def draft() -> None:
                self.drafter.propose(self.root, self.past, tree)

            draft()  # warm-up
            self._draft_seconds[key] = self.commit_seconds + self._median(draft)
        return self._draft_seconds[key]
