"""Sliding-window attention in tree verification.

Gemma 3 interleaves layers that attend to the last ``sliding_window`` positions with full-attention
layers (Mistral slides in every layer, Qwen2/3 configs may mix them). transformers hands a 4D mask
it is given to every layer unchanged (``masking_utils``: "If the mask is already 4D, simply return
as-is"), so one tree mask would give sliding layers full attention once the sequence outgrows the
window. These models also take a dict {layer type: mask} (``causal_mask_mapping`` in
``modeling_gemma3.py`` and ``modeling_qwen2.py``), and that is what verification passes: the tree
mask for full layers and, for sliding ones, the same mask with every key ``sliding_window`` or more
positions behind its query blocked, transformers' own rule (``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``) applied to positions instead of cache indices, since a tree's
nodes share positions and a batch row's cache may hold free slots.

The base cache keeps every entry in sliding layers too (``cache.new_cache``): transformers'
``DynamicSlidingWindowLayer`` drops its oldest entries as it grows, and a tree's rejected entries
cannot be dropped from it afterwards. So the window is the mask's job, at the memory of a full layer.
"""

from __future__ import annotations

import torch

FULL = "full_attention"
SLIDING = "sliding_attention"


def layer_types(config) -> tuple[str, ...]:
    """Each decoder layer's attention type: ``config.layer_types``, or, for a config without them
    (Mistral), sliding in every layer when it sets ``sliding_window`` (as transformers'
    ``get_layer_types_and_kwargs`` infers), full otherwise. Other types (chunked, linear attention)
    raise ValueError: verification has no mask for them."""
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = SLIDING if getattr(config, "sliding_window", None) is not None else FULL
        types = [kind] * config.num_hidden_layers
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"layer types {unknown} cannot verify a tree (only {FULL} and {SLIDING} layers)")
    return tuple(types)


def key_positions(slots: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """(B, L + N) position of every key of a verification forward: a cache slot holds the row's
    entry number (occupied slots counted in order; a free slot's value is meaningless, it is masked),
    and the N new entries sit at their nodes' (B, N) ``query_positions``."""
    cached = slots.long().cumsum(dim=1) - 1  # (B, L)
    return torch.cat([cached.to(query_positions.device), query_positions], dim=1)


def windowed_mask(
    mask: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, window: int
) -> torch.Tensor:
    """``mask`` (B, 1, N, L + N) with every key ``window`` or more positions behind its query
    blocked; ``keys`` (B, L + N) from ``key_positions``. A node always keeps itself."""
    distance = query_positions[:, :, None] - keys[:, None, :]  # (B, N, L + N)
    far = (distance >= window).to(mask.device)[:, None]  # (B, 1, N, L + N)
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)


def masks_by_type(config, mask: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor):
    """The ``attention_mask`` a forward of ``config``'s model takes for the additive ``mask``
    (B, 1, N, K): ``mask`` itself when no layer slides, the windowed mask when every layer does, and
    {layer type: mask} when they mix; ``keys`` (B, K) the position of every key."""
    types = set(layer_types(config))
    if SLIDING not in types:
        return mask
    windowed = windowed_mask(mask, query_positions, keys, config.sliding_window)
    return windowed if types == {SLIDING} else {FULL: mask, SLIDING: windowed}


def layer_masks(config, mask: torch.Tensor, slots: torch.Tensor, query_positions: torch.Tensor):
    """``masks_by_type`` for a verification forward: the tree ``mask`` over a cache whose occupied
    ``slots`` give its keys' positions (computed only when a layer slides)."""
    if SLIDING not in layer_types(config):
        return mask
    return masks_by_type(config, mask, query_positions, key_positions(slots, query_positions))
