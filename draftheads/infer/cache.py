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
