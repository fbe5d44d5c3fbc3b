"""KV-cache bookkeeping for tree verification, on transformers' own ``DynamicCache``.

After verifying a tree, the base cache holds prefix + all N tree nodes; only the accepted path's
entries may stay. ``keep_accepted`` moves them to the front of the tree region and crops the rest
(cheap at any prefix length, where re-indexing the whole cache grows with it: docs/inference.md).

A drafter's cache is rolled back instead (its ``DynamicCache`` objects, ``head.draft_caches(cache)``:
one for EAGLE/EAGLE-3, one per module for MTP):
its tree entries were computed from the drafter's own predicted states, not from the base model's
features, so ``crop_to_lengths`` drops them all and the head's ``catch_up`` recomputes the accepted
positions from real features (as EAGLE does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(model) -> DynamicCache:
    """An empty cache laid out for ``model`` (one dynamic layer per decoder layer)."""
    return DynamicCache(config=model.config)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's initialised layers; refuses layers a tree cannot be compacted in."""
    layers = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            raise TypeError(
                f"cache layer {index} is a {type(layer).__name__}; tree decoding needs plain DynamicLayer "
                "caches (sliding-window and linear-attention layers cannot drop arbitrary tree entries)"
            )
        if layer.is_initialized and layer.keys.numel() > 0:
            layers.append(layer)
    return layers


def cache_lengths(caches: Sequence[DynamicCache]) -> tuple[int, ...]:
    """Entries held by each of a drafter's caches."""
    return tuple(cache.get_seq_length() for cache in caches)


def crop_to_lengths(caches: Sequence[DynamicCache], lengths: Sequence[int]) -> None:
    """Drop every entry after ``lengths`` (from ``cache_lengths``), in place."""
    if len(lengths) != len(caches):
        raise ValueError(f"expected {len(caches)} cache lengths, got {len(lengths)}")
    for cache, length in zip(caches, lengths):
        excess = cache.get_seq_length() - length
        if excess < 0:
            raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} entries to {length}")
        if excess:
            for layer in _layers(cache):
                layer.crop(-excess)


def keep_accepted(cache: DynamicCache, past_length: int, accepted: torch.Tensor) -> None:
    """Keep the prefix and the accepted tree nodes' entries, in path order; drop the other nodes.

    Args:
        cache: the base cache after verification: ``past_length`` prefix entries + the tree's N.
        past_length: entries before the tree.
        accepted: (A,) accepted node indices within the tree, ascending, starting at the root (0).
    """
    layers = _layers(cache)
    total = cache.get_seq_length()
    kept = accepted.numel()
    if kept == 0 or past_length + kept > total:
        raise ValueError(f"cannot keep {kept} tree entries after {past_length} in a cache of {total}")
    # A path through a tree listed parents-first has accepted[i] >= i, so when it is a plain prefix of
    # the tree only the crop is needed; otherwise gather (a copy) and write the front of the tree region.
    contiguous = bool((accepted.cpu() == torch.arange(kept)).all())
    if not contiguous:
        index = (past_length + accepted).to(layers[0].keys.device)  # (A,)
        for layer in layers:
            layer.keys[:, :, past_length : past_length + kept] = layer.keys.index_select(2, index)
            layer.values[:, :, past_length : past_length + kept] = layer.values.index_select(2, index)
    excess = total - past_length - kept
    if excess:
        for layer in layers:
            layer.crop(-excess)


def keep_accepted_rows(
    cache: DynamicCache, lengths: Sequence[int], tree_start: int, accepted: Sequence[torch.Tensor]
) -> list[int]:
    """``keep_accepted`` for a batch whose rows hold ``lengths[b]`` valid entries, left-aligned:
    row b's accepted tree entries (at ``tree_start + accepted[b]``) move to just after its valid
    entries, and the cache is cropped to the longest row. Returns the new lengths.

    Args:
        lengths: valid entries per row before the tree (<= ``tree_start``).
        tree_start: where the tree's entries begin (the cache length before verification).
        accepted: per row, (A_b,) accepted node indices, ascending, starting at the root (0).
    """
    if len(lengths) == 1 and lengths[0] == tree_start:
        keep_accepted(cache, tree_start, accepted[0])
        return [tree_start + accepted[0].numel()]
    layers = _layers(cache)
    total = cache.get_seq_length()
    nodes = [a.tolist() for a in accepted]
    kept = [len(path) for path in nodes]
    new_lengths = [length + count for length, count in zip(lengths, kept)]
    if min(kept) == 0 or max(path[-1] for path in nodes) >= total - tree_start:
        raise ValueError(f"cannot keep {kept} tree entries after {tree_start} in a cache of {total}")
    # Per row, source and destination slots, padded to the longest path by repeating the row's last
    # pair (the same write twice). A row whose path already sits where it belongs needs no move
    # (the longest rows in a step that accepts a tree's prefix, every row of equal length in a
    # plain step); if no row needs one, only the crop is left.
    width = max(kept)
    source = [[tree_start + n for n in path + path[-1:] * (width - len(path))] for path in nodes]
    destination = [
        list(range(length, length + len(path))) + [length + len(path) - 1] * (width - len(path))
        for length, path in zip(lengths, nodes)
    ]
    moving = [b for b in range(len(nodes)) if source[b] != destination[b]]
    if moving:
        device = layers[0].keys.device
        rows = torch.tensor(moving, device=device)[:, None]  # (M, 1)
        source_slots = torch.tensor([source[b] for b in moving], device=device)  # (M, width)
        destination_slots = torch.tensor([destination[b] for b in moving], device=device)
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # (B, H, L, D); advanced indices give (M, width, H, D)
                tensor[rows, :, destination_slots] = tensor[rows, :, source_slots]
    excess = total - max(new_lengths)
    if excess:
        for layer in layers:
            layer.crop(-excess)
    return new_lengths


def select_rows(cache: DynamicCache, rows: Sequence[int], length: int) -> None:
    """Keep only the batch rows ``rows`` (in that order) and the first ``length`` entries, in place."""
    index = None
    for layer in _layers(cache):
        if index is None:
            index = torch.tensor(list(rows), dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(0, index)[:, :, :length]
        layer.values = layer.values.index_select(0, index)[:, :, :length]
