"""Drafting for a batch: every row's Drafter proposes its own tree, and the rows' head forwards at
the same depth run as one batched ``draft_step``.

A Drafter's ``propose_steps`` yields each ``Expansion`` it needs (``draft.py``). ``propose_rows``
runs the rows' generators in lockstep: each round, the pending expansions of the same head, depth
and cache are stacked (each row's draft cache left-aligned and padded to the longest, its stale
slots masked, as the base cache is in ``forward.rows_forward``), run in one forward, and each row's
new entries are appended to its own cache. A row whose drafter needs no forward (the context
drafter, a head sitting a step out) finishes at once. Each row's result depends only on its own
inputs, so the trees are what each row would have drafted alone, up to floating-point rounding of
the batched kernels; verification decides what is accepted either way.

Catching up on the accepted tokens (a ``CatchUp``) is batched the same way for heads whose
``catch_up`` takes a mask (``batch_catch_up``): the rows' new positions are left-padded to the
longest, so each row's last position, whose state drafting starts from, is its real last one. The
drafters that draft every depth in one forward batch it too: Medusa's heads on the rows' last
features stacked (``DepthLogits``), DFlash's block over each row's own context cache, the rows'
new context rows left-padded (``BlockForward``), and P-EAGLE's new rows and mask rows the same
way (``ChainForward``). What stays per row is the Python bookkeeping of
each tree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Generator, Sequence

import torch

from draftheads.heads.base import CatchUpStage
from draftheads.heads.layers import additive_mask
from draftheads.infer.draft import (
    BlockForward,
    CatchUp,
    ChainForward,
    DepthLogits,
    Draft,
    Drafter,
    Expansion,
    HeadForward,
    root_only,
)

# What one more catch-up forward costs, in padded positions: ``catch_up_groups`` pads rows into a
# shared forward only while the padding costs less than a forward of their own (the timings this
# stands for: docs/inference.md, "Batches: one tree per row, one forward").
CATCH_UP_PADDING_LIMIT = 64


def propose_rows(
    drafters: Sequence[Drafter], roots: Sequence[int], positions: Sequence[int], trees: Sequence
) -> list[Draft]:
    """One Draft per row: ``drafters[b].propose(roots[b], positions[b], trees[b])``, with the rows'
    head forwards batched; a row whose tree is None verifies its root alone."""
    steps = {
        row: drafter.propose_steps(root, position, tree)
        for row, (drafter, root, position, tree) in enumerate(zip(drafters, roots, positions, trees))
        if tree is not None
    }
    drafts = _in_lockstep(steps, _group, lambda rows, group: TOGETHER[type(group[0])](group))
    return [drafts[row] if row in drafts else root_only(root) for row, root in enumerate(roots)]


def _in_lockstep(steps: dict[int, Generator], key, run) -> dict[int, object]:
    """Drive the rows' generators together: each round, the requests they yield are grouped by
    ``key(request)``, each group goes to ``run(rows, requests)`` (one result per request, in order)
    and each result is sent back to its generator; returns what each row's generator returns."""
    returned: dict[int, object] = {}
    pending: dict[int, object] = {}

    def advance(row: int, result) -> None:
        try:
            pending[row] = steps[row].send(result)
        except StopIteration as done:
            returned[row] = done.value

    for row in steps:
        advance(row, None)
    while pending:
        groups: dict[object, list[int]] = defaultdict(list)
        for row, request in pending.items():
            groups[key(request)].append(row)
        requests, pending = pending, {}
        for rows in groups.values():
            for row, result in zip(rows, run(rows, [requests[row] for row in rows])):
                advance(row, result)
    return returned


def _group(request: HeadForward) -> tuple:
    """Requests that can share one forward: the same kind of forward of the same head (and, for an
    expansion, the same depth and draft cache)."""
    if isinstance(request, Expansion):
        return (Expansion, id(request.head), request.depth, request.cache_index)
    return (type(request), id(request.head))


def _stack_caches(head, caches, index: int, longest: int):
    """A new draft cache of ``head`` whose ``index``-th cache holds the rows' ``caches`` (each a
    batch of one) stacked, left-aligned and zero-padded to ``longest`` entries; a cache that holds
    nothing yet (a row that has just joined the batch) is all padding."""
    batched = head.new_cache()
    target = head.draft_caches(batched)[index]
    filled = [cache for cache in caches if cache.get_seq_length()]
    if not filled:
        return batched, target
    for layer in range(len(filled[0].layers)):
        stacked = []
        for name in ("keys", "values"):
            like = getattr(filled[0].layers[layer], name)  # (1, H, keys, D)
            padded = like.new_zeros(len(caches), like.shape[1], longest, like.shape[-1])
            for row, cache in enumerate(caches):
                if cache.get_seq_length():
                    tensor = getattr(cache.layers[layer], name)  # (1, H, keys_b, D)
                    padded[row, :, : tensor.shape[2]] = tensor[0]
            stacked.append(padded)
        target.update(*stacked, layer)
    return batched, target


def _append_rows(target, caches, slots) -> None:
    """Append to each row's own cache its new entries from the stacked ``target``: row b's are the
    slots ``slots[b]`` (a slice)."""
    for row, (cache, where) in enumerate(zip(caches, slots)):
        for layer in range(len(target.layers)):
            new = [
                getattr(target.layers[layer], name)[row : row + 1, :, where] for name in ("keys", "values")
            ]
            cache.update(*new, layer)


def _left_padded(tensors: Sequence[torch.Tensor], widest: int) -> torch.Tensor:
    """Rows' (1, n_b, ...) tensors stacked as (B, widest, ...), each padded on the left with its own
    first entry (zeros where it has none)."""
    rows = []
    for tensor in tensors:
        row, pad = tensor[0], widest - tensor.shape[1]
        filler = row[:1].expand(pad, *row.shape[1:]) if row.shape[0] else row.new_zeros(pad, *row.shape[1:])
        rows.append(torch.cat([filler, row]))
    return torch.stack(rows)


def _catch_up_visible(keys: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
    """(B, widest, longest + widest) bool: what the new positions of a catch-up see, over stacked
    caches (row b's ``keys[b]`` entries left-aligned) and new positions left-padded (row b's
    ``counts[b]`` at the end): a row's position its cached prefix and its new positions up to
    itself, a padding position only itself; nothing sees a padding position."""
    longest, widest = max(keys), max(counts)
    visible = torch.zeros(len(keys), widest, longest + widest, dtype=torch.bool)
    visible[:, :, longest:].diagonal(dim1=1, dim2=2).fill_(True)  # every position sees itself
    for row, (seen, count) in enumerate(zip(keys, counts)):
        pad = widest - count
        visible[row, pad:, :seen] = True
        visible[row, pad:, longest + pad :] = torch.ones(count, count, dtype=torch.bool).tril()
    return visible


def _catch_up_mask(keys: Sequence[int], counts: Sequence[int], dtype) -> torch.Tensor:
    """``_catch_up_visible`` as a (B, 1, widest, longest + widest) additive mask."""
    return additive_mask(_catch_up_visible(keys, counts), dtype)[:, None]


def catch_up_groups(counts: Sequence[int], limit: int = CATCH_UP_PADDING_LIMIT) -> list[list[int]]:
    """The rows (indices of ``counts``, each row's new positions) of a batch's catch-up grouped into
    forwards, at the least cost when a forward costs its rows times its widest row's positions plus
    ``limit`` positions of its own (the best grouping takes rows in order of width: a dynamic
    programme over where each group starts)."""
    order = sorted(range(len(counts)), key=lambda row: (-counts[row], row))
    widths = [counts[row] for row in order]
    best = [0.0] + [math.inf] * len(order)  # best[j]: the cost of the j widest rows
    start = [0] * (len(order) + 1)  # where the last group of the best best[j] starts
    for end in range(1, len(order) + 1):
        for first in range(end):
            cost = best[first] + (end - first) * widths[first] + limit
            if cost < best[end]:
                best[end], start[end] = cost, first
    groups, end = [], len(order)
    while end:
        groups.append(sorted(order[start[end] : end]))
        end = start[end]
    return groups[::-1]


def catch_up_together(
    requests: Sequence[CatchUp], limit: int = CATCH_UP_PADDING_LIMIT
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run rows' catch-ups (one head, each row on its own draft cache) as one ``catch_up``, or for a
    head with a staged catch-up (MTP) one forward per stage (``staged_catch_up_together``); return
    each one's (1, h) state and (1, V) logits and append its new entries to its own cache, as
    ``CatchUp.run`` does for one. Row b's n_b new positions sit at the end of the padded width
    (left padding); a padding position sees only itself and nothing sees it. Rows catching up on
    far more positions than the others (rows that have just joined the batch, on their prompts)
    run in forwards of their own (``catch_up_groups`` with ``limit``)."""
    results: list = [None] * len(requests)
    for group in catch_up_groups([r.next_ids.shape[1] for r in requests], limit):
        for row, result in zip(group, _catch_up_group([requests[row] for row in group])):
            results[row] = result
    return results


def _catch_up_group(requests: Sequence[CatchUp]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``catch_up_together`` for rows that run in one forward (or one per stage)."""
    head = requests[0].head
    if len(requests) > 1 and head.staged_catch_up:
        return staged_catch_up_together(requests)
    if len(requests) == 1 or not head.batch_catch_up:
        return [request.run() for request in requests]
    caches = [head.draft_caches(r.cache)[0] for r in requests]
    keys = [cache.get_seq_length() for cache in caches]
    counts = [r.next_ids.shape[1] for r in requests]
    longest, widest = max(keys), max(counts)
    batched, target = _stack_caches(head, caches, 0, longest)
    device = requests[0].features.device
    states, logits = head.catch_up(
        batched,
        _left_padded([r.features for r in requests], widest),  # (B, widest, F)
        _left_padded([r.next_ids for r in requests], widest),  # (B, widest)
        _left_padded([r.position_ids for r in requests], widest),  # (B, widest)
        attention_mask=_catch_up_mask(keys, counts, requests[0].features.dtype).to(device),
    )
    _append_rows(target, caches, [slice(longest + widest - count, longest + widest) for count in counts])
    return [(states[row : row + 1], logits[row : row + 1]) for row in range(len(requests))]


def staged_catch_up_together(requests: Sequence[CatchUp]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``catch_up_together`` for a head whose catch-up runs in stages, each over one of its draft
    caches (``DraftHead.catch_up_stages``; MTP: a module each): the rows' stage generators run in
    lockstep, the stages of one draft cache as one ``run_stage`` over the rows' caches stacked and
    their positions left-padded, and the logits of every row's final state as one call."""
    head = requests[0].head

    def run(rows: list[int], stages: list[CatchUpStage]) -> list[torch.Tensor]:
        """The stages of one draft cache, one per row in ``rows``, as one ``run_stage``."""
        index = stages[0].cache_index
        caches = [head.draft_caches(requests[row].cache)[index] for row in rows]
        keys = [cache.get_seq_length() for cache in caches]
        counts = [stage.hidden.shape[1] for stage in stages]
        longest, widest = max(keys), max(counts)
        _, target = _stack_caches(head, caches, index, longest)
        stacked = CatchUpStage(
            index,
            _left_padded([stage.hidden for stage in stages], widest),  # (b, widest, h)
            _left_padded([stage.token_ids for stage in stages], widest),  # (b, widest)
            _left_padded([stage.position_ids for stage in stages], widest),  # (b, widest)
        )
        mask = _catch_up_mask(keys, counts, stacked.hidden.dtype).to(stacked.hidden.device)
        outputs = head.run_stage(stacked, target, mask)  # (b, widest, h)
        _append_rows(target, caches, [slice(longest + widest - count, longest + widest) for count in counts])
        return [outputs[position : position + 1, widest - count :] for position, count in enumerate(counts)]

    steps = {
        row: head.catch_up_stages(r.cache, r.features, r.next_ids, r.position_ids)
        for row, r in enumerate(requests)
    }
    states = _in_lockstep(steps, lambda stage: stage.cache_index, run)
    state = torch.cat([states[row] for row in range(len(requests))])  # (B, h)
    logits = head.catch_up_logits(state)  # (B, V)
    return [(state[row : row + 1], logits[row : row + 1]) for row in range(len(requests))]


def run_together(expansions: Sequence[Expansion]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run expansions of one head at one depth (one per row, each on its own draft cache) as one
    ``draft_step``; return each one's (n_b, h) states and (n_b, V) logits, and append its new
    entries to its own cache, as ``Expansion.run`` does for one."""
    if len(expansions) == 1 or not expansions[0].head.batch_drafting:
        return [expansion.run() for expansion in expansions]
    head, index, depth = expansions[0].head, expansions[0].cache_index, expansions[0].depth
    caches = [head.draft_caches(e.cache)[index] for e in expansions]
    keys = [e.visible.shape[1] - e.token_ids.numel() for e in expansions]  # entries each row sees
    counts = [e.token_ids.numel() for e in expansions]
    longest, widest = max(keys), max(counts)
    first = expansions[0].parent_states
    dtype, device = first.dtype, first.device

    batched, target = _stack_caches(head, caches, index, longest)
    visible = torch.zeros(len(expansions), widest, longest + widest, dtype=torch.bool)
    visible[:, :, longest:].diagonal(dim1=1, dim2=2).fill_(True)  # padding nodes see themselves
    states, token_ids, position_ids = [], [], []
    for row, (expansion, seen, count) in enumerate(zip(expansions, keys, counts)):
        visible[row, :count, :seen] = expansion.visible[:, :seen]
        visible[row, :count, longest : longest + count] = expansion.visible[:, seen:]
        pad = widest - count
        states.append(torch.cat([expansion.parent_states, expansion.parent_states[:1].expand(pad, -1)]))
        token_ids.append(torch.cat([expansion.token_ids, expansion.token_ids[:1].expand(pad)]))
        position_ids.append(torch.cat([expansion.position_ids, expansion.position_ids[:1].expand(pad)]))
    mask = additive_mask(visible, dtype)
    out_states, out_logits = head.draft_step(
        batched,
        depth,
        torch.stack(states),  # (B, n, h)
        torch.stack(token_ids),  # (B, n)
        torch.stack(position_ids),  # (B, n)
        mask[:, None].to(device),  # (B, 1, n, longest + n)
    )
    _append_rows(target, caches, [slice(longest, longest + count) for count in counts])
    return [(out_states[row, :count], out_logits[row, :count]) for row, count in enumerate(counts)]


def logits_together(requests: Sequence[DepthLogits]) -> list[torch.Tensor]:
    """Run rows' ``DepthLogits`` (one head) as one ``draft_logits`` over their features stacked;
    return each one's (K, V) logits."""
    if len(requests) == 1:
        return [requests[0].run()]
    logits = requests[0].head.draft_logits(torch.cat([r.features for r in requests]))  # (B, 1, K, V)
    return [logits[row, -1] for row in range(len(requests))]


def _rows_then_queries(
    keys: Sequence[int], counts: Sequence[int], positions: Sequence[int], queries: int, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout of a forward that appends rows' new rows and then ``queries`` query rows to their
    stacked caches (row b's ``keys[b]`` entries left-aligned, its ``counts[b]`` new rows left-padded,
    the last at ``positions[b] - 1``). Returns the (B, widest + Q, longest + widest + Q) bool
    visibility: a new row sees its cached prefix and its new rows up to itself (``_catch_up_visible``),
    a query row those and the query rows (up to itself where ``causal``, else all of them), a padding
    row only itself, and nothing sees a padding row; and the (B, widest + Q) position ids: the query
    rows at positions[b] onwards, a padding row at its row's first new position."""
    longest, widest = max(keys), max(counts)
    visible = torch.zeros(len(keys), widest + queries, longest + widest + queries, dtype=torch.bool)
    visible[:, :widest, : longest + widest] = _catch_up_visible(keys, counts)  # the new rows
    among = torch.ones(queries, queries, dtype=torch.bool)
    visible[:, widest:, longest + widest :] = among.tril() if causal else among
    position_ids = []
    for row, (seen, count, position) in enumerate(zip(keys, counts, positions)):
        pad = widest - count
        visible[row, widest:, :seen] = True  # query rows: the cached prefix and the real new rows
        visible[row, widest:, longest + pad : longest + widest] = True
        first = position - count  # the first new row's position
        position_ids.append(
            torch.cat(
                [
                    torch.full((pad,), max(first, 0), dtype=torch.long),
                    torch.arange(first, position + queries, dtype=torch.long),
                ]
            )
        )
    return visible, torch.stack(position_ids)


def blocks_together(requests: Sequence[BlockForward]) -> list[torch.Tensor]:
    """Run rows' ``BlockForward`` (one head, each row on its own context cache) as one
    ``draft_blocks``; return each one's (K - 1, V) logits and append its new context rows to its own
    cache, as ``BlockForward.run`` does for one.

    Keys: the rows' caches stacked (left-aligned, padded to the longest), then the new context rows
    (row b's n_b at the end of the padded width: left padding), then the K block rows. A context row
    sees its row's cached prefix and its new rows up to itself, a block row sees all of them and the
    whole block, a padding row only itself; nothing sees a padding row."""
    if len(requests) == 1:
        return [requests[0].run()]
    head, caches = requests[0].head, [r.cache for r in requests]
    keys = [cache.get_seq_length() for cache in caches]
    counts = [r.features.shape[1] for r in requests]
    longest, widest = max(keys), max(counts)
    batched, target = _stack_caches(head, caches, 0, longest)
    positions = [r.position for r in requests]
    visible, position_ids = _rows_then_queries(keys, counts, positions, head.block_size, causal=False)
    features = _left_padded([r.features for r in requests], widest)  # (B, widest, F)
    device = features.device
    # (B, 1, widest + K, longest + widest + K)
    mask = additive_mask(visible, features.dtype)[:, None].to(device)
    logits = head.draft_blocks(
        batched,
        features,
        torch.tensor([r.root for r in requests], dtype=torch.long, device=device),
        position_ids.to(device),  # (B, widest + K)
        mask,
    )
    _append_rows(target, caches, [slice(longest + widest - count, longest + widest) for count in counts])
    return [logits[row] for row in range(len(requests))]


def chains_together(requests: Sequence[ChainForward]) -> list[torch.Tensor]:
    """Run rows' ``ChainForward`` (one head, each row on its own drafter cache) as one
    ``draft_chains``; return each one's (D, N) logits and append its new rows to its own cache, as
    ``ChainForward.run`` does for one.

    Keys: the rows' caches stacked (left-aligned, padded to the longest), then the new rows (row b's
    n_b at the end of the padded width: left padding, so every row's root row is the last), then the
    D - 1 mask rows. A new row sees its row's cached prefix and its new rows up to itself, a mask row
    those, the root's row and the mask rows up to itself, a padding row only itself; nothing sees a
    padding row. Mask rows are not appended: they are not context."""
    depths = requests[0].depths
    if len(requests) == 1 or any(r.depths != depths for r in requests):
        return [request.run() for request in requests]
    head, caches = requests[0].head, [r.cache for r in requests]
    keys = [cache.get_seq_length() for cache in caches]
    counts = [r.next_ids.shape[1] for r in requests]
    for request, seen, count in zip(requests, keys, counts):
        head.check_chain(seen, count, request.position, depths)
    longest, widest = max(keys), max(counts)
    batched, target = _stack_caches(head, caches, 0, longest)
    positions = [r.position for r in requests]
    visible, position_ids = _rows_then_queries(keys, counts, positions, depths - 1, causal=True)
    features = _left_padded([r.features for r in requests], widest)  # (B, widest, F)
    device = features.device
    logits = head.draft_chains(
        batched,
        features,
        _left_padded([r.next_ids for r in requests], widest),  # (B, widest)
        position_ids.to(device),  # (B, widest + D - 1)
        additive_mask(visible, features.dtype)[:, None].to(device),  # (B, 1, widest + D - 1, keys)
        depths,
    )
    _append_rows(target, caches, [slice(longest + widest - count, longest + widest) for count in counts])
    return [logits[row] for row in range(len(requests))]


# Each kind of head forward, run for every row of a batch that needs it in one call.
TOGETHER = {
    ChainForward: chains_together,
    CatchUp: catch_up_together,
    Expansion: run_together,
    DepthLogits: logits_together,
    BlockForward: blocks_together,
}
