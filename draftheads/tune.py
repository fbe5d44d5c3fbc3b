"""``draftheads tune-tree``: pick the draft tree that maximises expected tokens/s on this machine.

No fixed tree is right everywhere: how many candidates pay off depends on how often the head is
right at each depth and rank, and on what verifying N tokens costs here (REFERENCE.md sec. 5-6: on
this CPU N = 16 costs 1.3-1.8x one token, on a GPU nearly nothing). So we measure both and choose:

1. Acceptance. On held-out prompts and the base model's greedy continuation, one base forward gives
   the base's greedy token g[t] after every prefix. At position t (root x[t+1] = g[t]) the depth-d
   draft is judged against g[t+d], counted only while the true path is the greedy path
   (x[t+1+j] = g[t+j] for j < d). Parallel heads (Medusa) give all depths at once from
   ``draft_logits``; autoregressive heads run their drafter along the true path (teacher forcing,
   through ``catch_up`` / ``draft_step``, exactly as in decoding). The rank of the true token among
   the head's top-k gives ``acceptance[d][r]`` = P(rank-r candidate at depth d is the base's token |
   the path to its parent was accepted, i.e. every earlier depth within the top-k).
2. Cost. cost(N) = one base forward of N tree tokens after a prefix (mask, checks and cache
   compaction included), relative to N = 1, median over interleaved repeats; plus the time of the
   head's own drafting for each candidate tree, timed with the real drafting code.
3. Choice. A tree's expected tokens per step is 1 + sum of its nodes' path probabilities (a node is
   accepted iff its whole path is); expected speedup = that / (cost(N) + draft cost), in units of
   one plain decoding step. Static trees (Medusa, MTP) grow greedily by the highest path probability
   (Medusa paper, sec. 3.3.1, "optimal sparse tree"), every size is scored and the best kept; EAGLE
   dynamic trees are a grid over (top_k, depth, total_tokens), each scored on the EAGLE-2 selection
   simulated with the acceptance model standing in for the drafter's confidence.

The choice is saved with the head (``tree.json``, keyed by device and dtype, read by
``draftheads.infer.tree.load_tuned_tree``), with the measured curves (``tune-<device>-<dtype>.json``)
and a chart (``.png``).
"""

from __future__ import annotations

import argparse
import copy
import heapq
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftheads.arguments import add_no_pack_argument, at_least, non_negative_int, positive_int
from draftheads.infer.tree import (
    TUNED_TREE_FILE,
    TUNED_TREE_FORMAT,
    DynamicTree,
    StaticTree,
    padded_size,
    tree_to_dict,
    tree_topology,
    tuned_tree_key,
)


@dataclass(frozen=True)
class TuneSettings:
    """Every default of ``draftheads tune-tree`` (the CLI only overrides these)."""

    # prompts: mt-bench | humaneval | a prompt .jsonl (bench's form) | a conversation source (first user turns)
    data: str = "sharegpt"
    skip: int = 10000  # skip the first N prompts: the shipped configs train on ShareGPT's first 2,600 (eagle3: 9,000)
    prompts: int = 8  # held-out prompts
    max_new_tokens: int = 128  # greedy continuation per prompt (the positions measured)
    max_prompt_tokens: int = 256  # longer prompts are skipped
    top_k: int = 8  # ranks measured per depth
    max_depth: int = 6  # depths measured for heads without a fixed depth (EAGLE)
    max_nodes: int = 64  # largest tree considered (root included)
    prefix_tokens: int = 200  # context before the timed tree forwards
    repeats: int = 5  # timed repeats (median)
    dtype: str = "float32"
    device: str = "cpu"


# ---- the acceptance model -----------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceModel:
    """``probabilities[d][r]``: P(the rank-r candidate at depth d + 1 is the base model's token | the
    path to its parent was accepted); ``counts[d]``: positions behind depth d + 1's estimate."""

    probabilities: tuple[tuple[float, ...], ...]  # (D, K)
    counts: tuple[int, ...]  # (D,)

    @property
    def depth(self) -> int:
        return len(self.probabilities)

    @property
    def top_k(self) -> int:
        return len(self.probabilities[0]) if self.probabilities else 0

    def path_probability(self, path: Sequence[int]) -> float:
        """P(every node on ``path`` (ranks by depth) is accepted), under the factorised model."""
        probability = 1.0
        for depth, rank in enumerate(path):
            if depth >= self.depth or rank >= self.top_k:
                return 0.0
            probability *= self.probabilities[depth][rank]
        return probability


def acceptance_from_ranks(ranks: torch.Tensor, top_k: int) -> AcceptanceModel:
    """Estimate the model from (P, D) ranks of the true token per position and depth: ``top_k`` for
    a miss, -1 where the depth cannot be judged (the true path left the greedy path, or the end)."""
    ranks = ranks.long()
    probabilities, counts = [], []
    for depth in range(ranks.shape[1]):
        parents_in_reach = (ranks[:, :depth] >= 0).all(dim=1) & (ranks[:, :depth] < top_k).all(dim=1)  # (P,)
        judged = ranks[parents_in_reach & (ranks[:, depth] >= 0), depth]  # (M,)
        counts.append(int(judged.numel()))
        hits = torch.bincount(judged.clamp(max=top_k), minlength=top_k + 1)[:top_k].double()  # (K,)
        probabilities.append(tuple((hits / max(judged.numel(), 1)).tolist()))
    return AcceptanceModel(tuple(probabilities), tuple(counts))


def true_token_ranks(candidates: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(M, K) candidate ids best first, (M,) true ids -> (M,) rank of the true id, K if absent."""
    hits = candidates == targets[:, None]  # (M, K)
    first = hits.int().argmax(dim=1)  # (M,)
    return torch.where(hits.any(dim=1), first, torch.full_like(first, candidates.shape[1]))


def judgeable(tokens: torch.Tensor, greedy: torch.Tensor, start: int, depth: int) -> torch.Tensor:
    """(P, D) bool for positions t = start .. T-2: may the depth-d draft at t be judged? Yes iff the
    true tokens up to depth d - 1, root included, are the base's greedy ones (x[t+1+j] = g[t+j],
    j < d), so that g[t+d] is what greedy verification would compare it with."""
    length = tokens.shape[0]
    matches = tokens[1:] == greedy[:-1]  # (T-1,) x[t+1] == g[t]
    positions = torch.arange(start, length - 1)  # (P,)
    result = torch.zeros(len(positions), depth, dtype=torch.bool)
    chain = torch.ones(len(positions), dtype=torch.bool)
    for d in range(1, depth + 1):
        index = positions + d - 1  # the newest link of the chain
        inside = index <= length - 2
        chain = chain & inside & matches[index.clamp(max=length - 2)]
        result[:, d - 1] = chain
    return result


# ---- measuring acceptance -----------------------------------------------------------------------


@torch.no_grad()
def base_pass(model, head, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One base forward over (T,) tokens: (T,) greedy next tokens and (1, T, F) head features."""
    output = model(tokens[None].to(model.device), output_hidden_states=list(head.feature_layers))
    greedy = output.logits[0].argmax(dim=-1).cpu()  # (T,)
    return greedy, head.select_features(output.hidden_states)


@torch.no_grad()
def parallel_ranks(head, features, tokens, greedy, start: int, depth: int, top_k: int, chunk: int = 32):
    """(P, depth) ranks for a parallel head: ``draft_logits`` at t, entry d - 1 against g[t+d]."""
    length = tokens.shape[0]
    valid = judgeable(tokens, greedy, start, depth)  # (P, D)
    ranks = torch.full(valid.shape, -1, dtype=torch.long)
    for first in range(start, length - 1, chunk):
        last = min(first + chunk, length - 1)
        logits = head.draft_logits(features[:, first:last])[0, :, :depth].float()  # (n, D, V)
        candidates = head.draft_to_target(torch.topk(logits, top_k, dim=-1).indices).cpu()  # (n, D, K)
        for d in range(1, depth + 1):
            rows = torch.arange(first, last)
            targets = greedy[(rows + d).clamp(max=length - 1)]  # (n,)
            ranks[first - start : last - start, d - 1] = true_token_ranks(candidates[:, d - 1], targets)
    return torch.where(valid, ranks, torch.full_like(ranks, -1))


@torch.no_grad()
def autoregressive_ranks(head, features, tokens, greedy, start: int, depth: int, top_k: int):
    """(P, depth) ranks for an autoregressive head, its drafter run along the true path.

    The drafter sees what it sees in decoding: ``catch_up`` over the accepted prefix, then one
    ``draft_step`` per depth on the true node (a chain, so the node sees every row written while
    drafting, EAGLE, or its module's prefix and itself, MTP), then its rows are rolled back."""
    from draftheads.infer.cache import cache_lengths, crop_to_lengths

    length = tokens.shape[0]
    device = features.device
    valid = judgeable(tokens, greedy, start, depth)  # (P, D)
    ranks = torch.full(valid.shape, -1, dtype=torch.long)
    cache = head.new_cache()
    ids = tokens.to(device)
    if start > 0:  # the prompt, in one call: row i consumes features i and token i + 1
        head.catch_up(
            cache, features[:, :start], ids[None, 1 : start + 1], torch.arange(start, device=device)[None]
        )
    for t in range(start, length - 1):
        state, logits = head.catch_up(
            cache, features[:, t : t + 1], ids[None, t + 1 : t + 2], torch.tensor([[t]], device=device)
        )  # (1, h), (1, V_draft)
        row = t - start
        if not valid[row, 0]:
            continue
        lengths = cache_lengths(head.draft_caches(cache))
        hidden = state[:, None]  # (1, 1, h)
        for d in range(1, depth + 1):
            candidates = head.draft_to_target(torch.topk(logits[-1].float(), top_k).indices)  # (K,)
            ranks[row, d - 1] = true_token_ranks(candidates.cpu()[None], greedy[t + d : t + d + 1])[0]
            if d == depth or not valid[row, d]:
                break
            # Expand the true depth-d node (its token x[t+1+d] = g[t+d]), as draft.py's _expand does.
            keys = cache_lengths(head.draft_caches(cache))[0 if head.draft_attends_ancestors else d] + 1
            mask = torch.zeros(1, 1, 1, keys, dtype=state.dtype, device=device)  # a chain sees all of it
            position = t + d if head.draft_attends_ancestors else t
            hidden, logits = head.draft_step(
                cache,
                d,
                hidden,
                ids[None, t + 1 + d : t + 2 + d],
                torch.tensor([[position]], device=device),
                mask,
            )  # (1, 1, h), (1, 1, V_draft)
            logits = logits[0]
        crop_to_lengths(head.draft_caches(cache), lengths)
    return torch.where(valid, ranks, torch.full_like(ranks, -1))


def measured_depth(head, max_depth: int) -> int:
    """Depths to measure: the head's own (Medusa K heads, MTP D modules), else ``max_depth``."""
    return head.num_draft_steps if head.num_draft_steps > 0 else max_depth


def measure_acceptance(
    model, head, sequences: Sequence[tuple[torch.Tensor, int]], depth: int, top_k: int, progress: bool = True
) -> AcceptanceModel:
    """The acceptance model over ``sequences`` of ((T,) tokens, index of the first generated token)."""
    from tqdm.auto import tqdm

    if top_k > head_vocab_size(head):
        raise ValueError(f"top_k {top_k} exceeds the head's vocabulary of {head_vocab_size(head)}")
    all_ranks = []
    for tokens, generated_from in tqdm(sequences, desc="acceptance", unit="seq", disable=not progress):
        greedy, features = base_pass(model, head, tokens)
        start = generated_from - 1  # the first root is the first generated token
        measure = parallel_ranks if head.drafting == "parallel" else autoregressive_ranks
        all_ranks.append(measure(head, features, tokens, greedy, start, depth, top_k))
    return acceptance_from_ranks(torch.cat(all_ranks), top_k)


def head_vocab_size(head) -> int:
    return getattr(head, "draft_vocab_size", None) or head.base_spec.vocab_size


# ---- costs --------------------------------------------------------------------------------------


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
    """The state of a decoder after a prefix (base cache, root token, drafter state), to time one
    step's pieces with the real code: verification forwards and the head's drafting."""

    @torch.no_grad()
    def __init__(self, model, head, prefix: torch.Tensor, pad_to_multiple: int, repeats: int):
        from draftheads.infer.cache import new_cache

        self.model, self.head, self.repeats = model, head, repeats
        self.pad_to_multiple = pad_to_multiple
        self.device = model.device
        ids = prefix[None].to(self.device)  # (1, T)
        self.cache = new_cache(model)
        output = model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=list(head.feature_layers),
        )
        self.past = ids.shape[1]
        self.root = int(output.logits[0, -1].argmax())
        features = head.select_features(output.hidden_states)  # (1, T, F)
        self.last_features = features[:, -1:]
        if head.drafting == "autoregressive":
            self.draft_cache = head.new_cache()
            next_ids = torch.cat([ids[:, 1:], ids.new_tensor([[self.root]])], dim=1)  # (1, T)
            positions = torch.arange(self.past, device=self.device)[None]  # (1, T)
            self.draft_state, self.draft_logits = head.catch_up(
                self.draft_cache, features, next_ids, positions
            )
            self.catch_up_seconds = self._catch_up_seconds(features[:, -3:])
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

    def _catch_up_seconds(self, features: torch.Tensor) -> float:
        """Median seconds of one step's ``catch_up`` (a typical step accepts ~3 tokens), each run on
        a copy of the drafter cache: catch_up also moves state that cropping does not undo (MTP)."""
        count = features.shape[1]
        ids = torch.full((1, count), self.root, dtype=torch.long, device=self.device)
        positions = self.past + torch.arange(count, device=self.device)[None]  # (1, n)
        times = []
        for _ in range(self.repeats + 1):  # the first is a warm-up
            cache = copy.deepcopy(self.draft_cache)
            _synchronize(self.device)
            started = time.perf_counter()
            self.head.catch_up(cache, features, ids, positions)
            _synchronize(self.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    @torch.no_grad()
    def verify_cost(self, sizes: Sequence[int], progress: bool = True) -> CostCurve:
        """Median seconds of verifying N tokens (forward + cache compaction), sizes interleaved."""
        from tqdm.auto import tqdm

        from draftheads.infer.cache import crop_to_lengths, keep_accepted
        from draftheads.infer.generate import tree_forward

        topologies = {n: tree_topology([-1] + list(range(n - 1))) for n in sizes}  # chains: cost is the size
        tokens = torch.full((max(sizes),), self.root, dtype=torch.long)
        first = torch.zeros(1, dtype=torch.long, device=self.device)

        def verify(n: int) -> None:
            tree_forward(self.model, self.cache, tokens[:n], topologies[n], self.head.feature_layers)
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
        """Median seconds the head needs to draft ``tree`` in one step (autoregressive heads: plus
        the step's ``catch_up`` on the accepted tokens); memoised by tree shape."""
        from draftheads.infer.cache import cache_lengths, crop_to_lengths
        from draftheads.infer.draft import draft_autoregressive, draft_parallel

        key = tree.choices if isinstance(tree, StaticTree) else (tree.top_k, tree.depth, tree.total_tokens)
        if key in self._draft_seconds:
            return self._draft_seconds[key]
        head = self.head
        if head.drafting == "parallel":
            topology = tree.topology(self.pad_to_multiple)

            def draft() -> None:
                draft_parallel(head, self.last_features, self.root, tree, topology)
        else:
            caches = head.draft_caches(self.draft_cache)
            lengths = cache_lengths(caches)

            def draft() -> None:
                draft_autoregressive(
                    head,
                    self.draft_cache,
                    self.root,
                    self.draft_state,
                    self.draft_logits,
                    self.past,
                    tree,
                    self.pad_to_multiple,
                )
                crop_to_lengths(caches, lengths)

        draft()  # warm-up
        catch_up = self.catch_up_seconds if head.drafting == "autoregressive" else 0.0
        self._draft_seconds[key] = catch_up + self._median(draft)
        return self._draft_seconds[key]


# ---- choosing the tree --------------------------------------------------------------------------


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


# ---- held-out data ------------------------------------------------------------------------------


def held_out_prompts(
    source: str, skip: int, count: int, tokenizer, max_prompt_tokens: int
) -> list[torch.Tensor]:
    """Chat-formatted first user turns: from eval prompts (mt-bench, humaneval) or from any
    conversation source, after skipping ``skip`` items (keep them out of the training data)."""
    from draftheads.data.prompts import EMBEDDED, load_prompts
    from draftheads.data.sources import read_conversations

    if source in EMBEDDED or _is_prompt_file(source):
        texts = [prompt.turns[0] for prompt in load_prompts(source)[skip:]]
    else:
        # Extra conversations in reserve for prompts that turn out too long.
        conversations, _ = read_conversations(source, limit=skip + 4 * count)
        texts = [
            next(m["content"] for m in c.messages if m["role"] == "user")
            for c in conversations[skip:]
            if any(m["role"] == "user" for m in c.messages)
        ]
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
        )
        if len(ids) <= max_prompt_tokens:
            prompts.append(torch.tensor(ids, dtype=torch.long))
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(
            f"--data {source}: no prompt of at most {max_prompt_tokens} tokens after skipping {skip}"
        )
    return prompts


def _is_prompt_file(source: str) -> bool:
    """A .jsonl of prompts (``turns`` or ``prompt``, as bench reads) rather than of conversations."""
    path = Path(source)
    if path.suffix != ".jsonl" or not path.is_file():
        return False
    with open(path, encoding="utf-8") as stream:
        first = next((line for line in stream if line.strip()), "{}")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and ("turns" in record or "prompt" in record)


def greedy_continuations(generator, prompts: list[torch.Tensor], max_new_tokens: int, progress: bool = True):
    """((T,) prompt + greedy continuation, prompt length) per prompt. Decoded with the head itself
    (lossless, so the tokens are the base's greedy ones; any float disagreement is caught later,
    where only positions whose path is the base's own greedy path are judged)."""
    from tqdm.auto import tqdm

    sequences = []
    for prompt in tqdm(prompts, desc="continuations", unit="prompt", disable=not progress):
        result = generator.generate(prompt, max_new_tokens=max_new_tokens)
        sequences.append((result.sequences[0], result.prompt_length))
    return sequences


# ---- saving -------------------------------------------------------------------------------------


def save_tuned_tree(head_dir: Path, key: str, best: Candidate, record: dict) -> list[Path]:
    """Merge the choice for ``key`` into ``tree.json``; write the curves and a chart next to it."""
    tree_path = head_dir / TUNED_TREE_FILE
    saved = {"format": TUNED_TREE_FORMAT, "trees": {}}
    if tree_path.is_file():
        previous = json.loads(tree_path.read_text())
        if previous.get("format") == TUNED_TREE_FORMAT:
            saved = previous
    saved["trees"][key] = {
        "tree": tree_to_dict(best.tree),
        "expected_tokens_per_step": best.expected_tokens,
        "expected_speedup": best.expected_speedup,
        "machine": record["machine"],
    }
    tree_path.write_text(json.dumps(saved, indent=2) + "\n")
    stem = "tune-" + key.replace("/", "-")
    curves_path = head_dir / f"{stem}.json"
    curves_path.write_text(json.dumps(record, indent=2) + "\n")
    return [tree_path, curves_path, plot_tuning(record, head_dir / f"{stem}.png")]


def plot_tuning(record: dict, path: Path) -> Path:
    """Acceptance by depth and rank, the verify cost curve, expected speedup by tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    probabilities = record["acceptance"]["probabilities"]
    depths = range(1, len(probabilities) + 1)
    for rank in range(min(3, len(probabilities[0]) if probabilities else 0)):
        axes[0].plot(depths, [row[rank] for row in probabilities], marker="o", label=f"rank {rank}")
    axes[0].plot(depths, [sum(row) for row in probabilities], marker="s", linestyle="--", label="top-k")
    axes[0].set(xlabel="depth", ylabel="P(accepted | parent accepted)", ylim=(0, 1), title="acceptance")
    axes[0].legend(fontsize=8)
    cost = record["verify_cost"]
    axes[1].plot(
        cost["sizes"],
        [s / cost["fitted_seconds"][0] for s in cost["seconds"]],
        "o",
        label="measured (median)",
    )
    axes[1].plot(cost["sizes"], cost["relative"], label="isotonic fit")
    axes[1].legend(fontsize=8)
    axes[1].set(
        xlabel="tree tokens N", ylabel="cost(N) / cost(1)", title=f"verify cost ({record['setting']})"
    )
    best_by_size: dict[int, float] = {}
    for candidate in record["candidates"]:
        best_by_size[candidate["nodes"]] = max(
            best_by_size.get(candidate["nodes"], 0.0), candidate["expected_speedup"]
        )
    sizes = sorted(best_by_size)
    axes[2].plot(sizes, [best_by_size[n] for n in sizes], marker=".")
    axes[2].axvline(record["chosen"]["nodes"], color="grey", linestyle=":")
    axes[2].set(
        xlabel="tree tokens N", ylabel="expected speedup", title=f"chosen: {record['chosen']['tree']['name']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the whole job ------------------------------------------------------------------------------


def tune_tree(
    model, head, tokenizer, head_dir: str | Path, settings: TuneSettings, progress: bool = True
) -> dict:
    """Measure, choose and save; returns the record written to ``tune-<device>-<dtype>.json``."""
    from draftheads.bench import machine_info
    from draftheads.infer.generate import SpeculativeGenerator
    from draftheads.infer.packed import has_packed_linears

    head_dir = Path(head_dir)
    generator = SpeculativeGenerator(model, head, tokenizer)  # its default tree; its padding rule
    pad = generator.pad_to_multiple
    prompts = held_out_prompts(
        settings.data, settings.skip, settings.prompts, tokenizer, settings.max_prompt_tokens
    )
    sequences = greedy_continuations(generator, prompts, settings.max_new_tokens, progress)
    depth = measured_depth(head, settings.max_depth)
    top_k = min(settings.top_k, head_vocab_size(head))
    acceptance = measure_acceptance(model, head, sequences, depth, top_k, progress)

    prefix = torch.cat([tokens for tokens, _ in sequences])[: settings.prefix_tokens]
    bench = DecodingBench(model, head, prefix, pad, settings.repeats)
    curve = bench.verify_cost(cost_sizes(settings.max_nodes, pad), progress)
    one_step = curve.seconds[curve.sizes.index(1)]

    def draft_cost(tree) -> float:
        return bench.draft_seconds(tree) / one_step

    dynamic = head.drafting == "autoregressive" and head.num_draft_steps < 0  # EAGLE: unbounded depth
    if dynamic:
        best, candidates = choose_dynamic_tree(
            acceptance, curve.relative, draft_cost, top_k, depth, settings.max_nodes, pad
        )
    else:
        best, candidates = choose_static_tree(acceptance, curve.relative, draft_cost, settings.max_nodes, pad)
    key = tuned_tree_key(model.dtype, model.device)
    record = {
        "setting": key,
        "settings": asdict(settings),
        "machine": machine_info(model.dtype, str(model.device)),
        "head": {"kind": head.kind, "dir": str(head_dir)},
        "tau_convention": "expected tokens per step count the token the base model produces itself",
        "acceptance": asdict(acceptance),
        "verify_cost": {
            "sizes": list(curve.sizes),
            "seconds": list(curve.seconds),
            "fitted_seconds": curve.fitted(),
            "relative": [curve.relative(n) for n in curve.sizes],
            "pad_to_multiple": pad,
            "packed_linears": has_packed_linears(model),
            "ceiling": {
                **dict(zip(("speedup", "tokens"), curve.ceiling())),
                "at_tau": [curve.speedup_bound(tau) for tau in (2, 3, 4)],
            },
        },
        "chosen": _candidate_dict(best),
        "candidates": [_candidate_dict(c) for c in candidates],
    }
    record["paths"] = [str(p) for p in save_tuned_tree(head_dir, key, best, record)]
    return record


def _candidate_dict(candidate: Candidate) -> dict:
    return {
        "tree": tree_to_dict(candidate.tree),
        "nodes": candidate.nodes,
        "expected_tokens": candidate.expected_tokens,
        "cost": candidate.cost,
        "expected_speedup": candidate.expected_speedup,
    }


def describe(record: dict) -> str:
    """A few lines for the terminal: acceptance, cost, the choice."""
    acceptance = record["acceptance"]
    top1 = " ".join(f"{row[0]:.2f}" for row in acceptance["probabilities"])
    topk = " ".join(f"{sum(row):.2f}" for row in acceptance["probabilities"])
    cost = record["verify_cost"]
    ceiling = cost["ceiling"]
    curve = ", ".join(
        f"{n}:{c:.2f}" for n, c in zip(cost["sizes"], cost["relative"]) if n in (1, 4, 8, 16, 32, 64)
    )
    chosen = record["chosen"]
    return (
        f"acceptance over {acceptance['counts'][0] if acceptance['counts'] else 0} positions, "
        f"P(accept | parent) by depth: top-1 {top1}; top-{len(acceptance['probabilities'][0])} {topk}\n"
        f"verify cost relative to 1 token ({record['setting']}, one token {1000 * cost['seconds'][0]:.1f} ms): {curve}\n"
        f"ceiling on this machine: {ceiling['speedup']:.2f}x (a head whose every draft is accepted, "
        f"drafting for free, with a {ceiling['tokens']}-token chain); at tau 2 / 3 / 4 at most "
        + " / ".join(f"{bound:.2f}x" for bound in ceiling["at_tau"])
        + "\n"
        f"chosen tree {chosen['tree']['name']} ({chosen['nodes']} tokens): expected {chosen['expected_tokens']:.2f} "
        f"tokens per step, step cost {chosen['cost']:.2f} plain steps, expected speedup {chosen['expected_speedup']:.2f}x"
        + (
            "\nwarning: no draft tree is expected to beat plain decoding on this machine: the head's "
            "acceptance is too low for what verifying and drafting cost here (train it longer, or decode "
            "without it)"
            if chosen["expected_speedup"] < 1.0
            else ""
        )
    )


# ---- command ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TuneSettings()
    parser.add_argument("--heads", required=True, help="head directory; the tuned tree is saved there")
    parser.add_argument("--base", default=None, help="base model (default: the one recorded in the head)")
    parser.add_argument("--data", default=defaults.data, help="mt-bench | humaneval | conversation source")
    parser.add_argument(
        "--skip", type=non_negative_int, default=defaults.skip, help="skip the first N prompts (training data)"
    )
    parser.add_argument("--prompts", type=positive_int, default=defaults.prompts, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=defaults.max_prompt_tokens)
    parser.add_argument("--top-k", type=positive_int, default=defaults.top_k, help="ranks measured per depth")
    parser.add_argument("--max-depth", type=positive_int, default=defaults.max_depth, help="depths measured (EAGLE)")
    parser.add_argument(
        "--max-nodes", type=at_least(2), default=defaults.max_nodes, help="largest tree (root included)"
    )
    parser.add_argument("--prefix-tokens", type=positive_int, default=defaults.prefix_tokens)
    parser.add_argument("--repeats", type=positive_int, default=defaults.repeats)
    parser.add_argument("--dtype", default=defaults.dtype, help="float32 | bfloat16 (costs differ by dtype)")
    parser.add_argument("--device", default=defaults.device)
    add_no_pack_argument(parser)


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    return TuneSettings(
        data=args.data,
        skip=args.skip,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        top_k=args.top_k,
        max_depth=args.max_depth,
        max_nodes=args.max_nodes,
        prefix_tokens=args.prefix_tokens,
        repeats=args.repeats,
        dtype=args.dtype,
        device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    from draftheads.base_model import load_base
    from draftheads.heads import load_head
    from draftheads.infer.packed import pack_linears

    settings = settings_from_args(args)
    head_dir = Path(args.heads)
    config_path = head_dir / "config.json"
    if not config_path.is_file():
        print(f"draftheads tune-tree: no config.json in head directory {head_dir}")
        return 2
    base = args.base or json.loads(config_path.read_text()).get("base_model", {}).get("name_or_path")
    if not base:
        print(f"draftheads tune-tree: {config_path} records no base model; pass --base")
        return 2
    model, tokenizer = load_base(base, dtype=settings.dtype, device=settings.device)
    head = load_head(head_dir, base_model=model, map_location=settings.device)
    if not args.no_pack:  # tune on the kernels generate and bench decode with by default
        pack_linears(model, head)
    started = time.perf_counter()
    record = tune_tree(model, head, tokenizer, head_dir, settings)
    print(describe(record))
    print(f"tuned in {time.perf_counter() - started:.0f} s; wrote " + ", ".join(record["paths"]))
    return 0
