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

What stays per row: catching up on the accepted tokens (``catch_up``, one short forward per row and
step) and the Python bookkeeping of each tree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from draftheads.infer.draft import Draft, Drafter, Expansion, root_only


def propose_rows(
    drafters: Sequence[Drafter], roots: Sequence[int], positions: Sequence[int], trees: Sequence
) -> list[Draft]:
    """One Draft per row: ``drafters[b].propose(roots[b], positions[b], trees[b])``, with the rows'
    head forwards batched; a row whose tree is None verifies its root alone."""
    drafts: list[Draft | None] = [None] * len(drafters)
    steps = {}
    for row, (drafter, root, position, tree) in enumerate(zip(drafters, roots, positions, trees)):
        if tree is None:
            drafts[row] = root_only(root)
        else:
            steps[row] = drafter.propose_steps(root, position, tree)
    pending: dict[int, Expansion] = {}

    def advance(row: int, result) -> None:
        try:
            pending[row] = steps[row].send(result)
        except StopIteration as done:
            drafts[row] = done.value

    for row in steps:
        advance(row, None)
    while pending:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for row, expansion in pending.items():
            groups[(id(expansion.head), expansion.depth, expansion.cache_index)].append(row)
        requests, pending = pending, {}
        for rows in groups.values():
            results = run_together([requests[row] for row in rows])
            for row, result in zip(rows, results):
                advance(row, result)
    return drafts


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

    batched = head.new_cache()
    target = head.draft_caches(batched)[index]
    for layer in range(len(caches[0].layers)):
        stacked = []
        for name in ("keys", "values"):
            rows = [getattr(cache.layers[layer], name) for cache in caches]  # (1, H, keys_b, D) each
            padded = rows[0].new_zeros(len(rows), *rows[0].shape[1:2], longest, rows[0].shape[-1])
            for row, tensor in enumerate(rows):
                padded[row, :, : tensor.shape[2]] = tensor[0]
            stacked.append(padded)
        target.update(*stacked, layer)

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
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    out_states, out_logits = head.draft_step(
        batched,
        depth,
        torch.stack(states),  # (B, n, h)
        torch.stack(token_ids),  # (B, n)
        torch.stack(position_ids),  # (B, n)
        mask[:, None].to(device),  # (B, 1, n, longest + n)
    )
    results = []
    for row, (cache, count) in enumerate(zip(caches, counts)):
        for layer in range(len(target.layers)):
            new = [
                getattr(target.layers[layer], name)[row : row + 1, :, longest : longest + count]
                for name in ("keys", "values")
            ]
            cache.update(*new, layer)
        results.append((out_states[row, :count], out_logits[row, :count]))
    return results
