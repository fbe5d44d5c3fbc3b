"""What one decoding step costs on this machine, measured with the real code.

cost(N) = one base forward verifying N tree tokens after a prefix (mask, checks and cache compaction
included), relative to N = 1, median over interleaved repeats; plus the time the head's Drafter
needs to propose a given tree and to commit a step's accepted tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from draftheads.infer.draft import drafter_for, next_token_ids
from draftheads.infer.forward import prefill_forward, prefill_rows
from draftheads.infer.tree import DynamicTree, StaticTree
from draftheads.infer.verify_cost import CostCurve, isotonic, measure_verify_cost
from draftheads.settings import ConfigError
from draftheads.timing import synchronize

__all__ = ["CostCurve", "DecodingBench", "cost_sizes", "isotonic"]

STEP_TOKENS = 3  # the tokens a typical step accepts (the root's included), committed before timing


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


class DecodingBench:
    """The state of a decoder after a prefix (base cache, root token, drafter), to time one step's
    pieces with the real code: verification forwards and the Drafter's ``propose`` and ``commit``."""

    @torch.inference_mode()
    def __init__(self, model, head, prefix: torch.Tensor, pad_to_multiple: int, repeats: int):
        self.model, self.head, self.repeats = model, head, repeats
        self.device = model.device
        self.drafter = drafter_for(head, pad_to_multiple)
        ids = prefix[None].to(self.device)  # (1, T)
        self.prefix = ids[0]
        self.cache, output = prefill_forward(model, ids, self.drafter.feature_layers)
        self.past = ids.shape[1]
        self.root = int(output.logits[0, -1].argmax())
        features = self.drafter.select_features(output.hidden_states)
        self._start_as_after_a_step(features, ids)
        self.commit_seconds = self._commit_seconds(features[:, -STEP_TOKENS:])
        self._draft_seconds: dict[object, float] = {}

    def _start_as_after_a_step(self, features: torch.Tensor, ids: torch.Tensor) -> None:
        """Leave the drafter as a decoding step finds it: the prefix but its last ``STEP_TOKENS``
        taken in and drafted from once, those tokens committed since, and caught up. A block
        drafter takes committed features in at its next forward, so one started on the whole
        prefix would run every timed forward over all of it; and a drafter that keeps the
        distributions it drafted from until the next commit must be timed after one."""
        split = self.past - STEP_TOKENS
        if split < 1:
            raise ConfigError(
                f"--prefix-tokens: timing a step needs a prefix of more than {STEP_TOKENS} tokens, "
                f"got {self.past}"
            )
        next_ids = next_token_ids(ids, self.root)  # (1, T)
        self.drafter.prefill(features[:, :split], next_ids[:, :split])
        self.drafter.propose(int(ids[0, split]), split, StaticTree("first", ((0,),)))
        self.drafter.commit(features[:, split:], next_ids[:, split:], split)
        self.drafter.flush()  # caught up: catching up is in commit_seconds

    def _median(self, action: Callable[[], None]) -> float:
        times = []
        for _ in range(self.repeats):
            synchronize(self.device)
            started = time.perf_counter()
            action()
            synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def _commit_seconds(self, features: torch.Tensor) -> float:
        """Median seconds of one step's ``commit`` (of ``STEP_TOKENS`` tokens), each run on a
        fork of the drafter: committing moves state that a rollback would not undo (MTP)."""
        count = features.shape[1]
        ids = torch.full((1, count), self.root, dtype=torch.long, device=self.device)
        times = []
        for _ in range(self.repeats + 1):  # the first is a warm-up
            drafter = self.drafter.fork()
            synchronize(self.device)
            started = time.perf_counter()
            drafter.commit(features, ids, self.past)
            drafter.flush()
            synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    @torch.inference_mode()
    def batch_verify_cost(self, batch: int, sizes: Sequence[int], progress: bool = True) -> CostCurve:
        """Median seconds of one batched step with ``batch`` rows (the prefix in every row), each
        verifying N tokens: what the decode loop weighs trees against at that batch size."""
        rows = [self.prefix] * batch
        cache, _, _ = prefill_rows(self.model, rows, ())
        return measure_verify_cost(
            self.model,
            cache,
            self.root,
            sizes,
            self.repeats,
            progress=progress,
            slots=torch.ones(batch, self.past, dtype=torch.bool),
        )

    def verify_cost(self, sizes: Sequence[int], progress: bool = True) -> CostCurve:
        """Median seconds of verifying N tokens (forward + cache compaction), sizes interleaved."""
        return measure_verify_cost(
            self.model, self.cache, self.root, sizes, self.repeats, self.drafter.feature_layers, progress
        )

    @torch.inference_mode()
    def draft_seconds(self, tree: StaticTree | DynamicTree) -> float:
        """Median seconds the drafter needs for one step with ``tree``: ``propose`` plus the step's
        ``commit`` of the accepted tokens; memoised by tree shape. Each propose runs on its own fork
        of the drafter, forked before the clock starts: a drafter that keeps the distributions it
        computed until the next commit (Medusa's depth logits, a block head's block) would answer a
        second propose from them, timing a step without its head forward."""
        key = tree.choices if isinstance(tree, StaticTree) else (tree.top_k, tree.depth, tree.total_tokens)
        if key not in self._draft_seconds:
            forks = [self.drafter.fork() for _ in range(self.repeats + 1)]
            forks.pop().propose(self.root, self.past, tree)  # warm-up

            def draft() -> None:
                forks.pop().propose(self.root, self.past, tree)

            self._draft_seconds[key] = self.commit_seconds + self._median(draft)
        return self._draft_seconds[key]
