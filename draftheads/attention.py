"""Grouped-query attention for many queries under a mask, without copying the keys and values.

With grouped-query attention (H query heads sharing H_kv key/value heads, n_rep = H / H_kv, as in
Llama 3, Qwen 2 and SmolLM2), transformers' SDPA path repeats every key and value head n_rep times
(``repeat_kv``) whenever more than one query comes with a mask: a copy of each layer's whole cache
on every forward. For a single query it folds a group's query heads into the query dimension
instead (``pack_gqa``). A tree verification forward brings N > 1 queries and a 4D mask, so it paid
the copy in every layer.

``folded_sdpa_attention`` folds for any number of queries: queries (B, H, N, D) become
(B, H_kv, n_rep * N, D) (head h = g * n_rep + r is query r * N + n of group g) and the mask,
shared by the heads, is repeated n_rep times along the query dimension, which is far smaller than
the keys and values it replaces. The scores are the same dot products, the kernel the same torch
SDPA; only the order of the work changes. Anything else (one query, no mask, a mask per head, no
grouping, dropout) goes to transformers' own SDPA function unchanged. Every layer of a forward gets
the same mask tensor; inside ``mask_repeats_shared()`` (the decoder's forwards run in it) it is
repeated once for all of them instead of once per layer.

``fold_grouped_queries(model)`` switches an SDPA model to it through transformers' attention
registry (``AttentionInterface``; the masks are SDPA's, ``AttentionMaskInterface``), the documented
way to plug in an attention function without touching a modeling file. Measured per layer on the
2-core CPU in docs/inference.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

FOLDED_SDPA = "draftheads_folded_sdpa"

# Inside ``mask_repeats_shared``: (id of a mask, n_rep) -> (that mask, its repeat). The entry keeps
# the mask alive, so no other tensor can take its id while the entry stands.
_REPEATS: ContextVar[dict | None] = ContextVar("draftheads_mask_repeats", default=None)


@contextmanager
def mask_repeats_shared() -> Iterator[None]:
    """Within it, a mask tensor the folded attention has repeated once is not repeated again:
    for one model forward, whose layers all get the same, unmodified mask. Do not modify a mask
    in place within it."""
    token = _REPEATS.set({})
    try:
        yield
    finally:
        _REPEATS.reset(token)


def repeated_mask(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``mask`` (B, 1, N, L) repeated ``n_rep`` times along the query dimension: (B, 1, n_rep * N, L);
    inside ``mask_repeats_shared`` the same tensor again for the same ``mask``."""
    repeats = _REPEATS.get()
    if repeats is None:
        return mask.repeat(1, 1, n_rep, 1)
    known = repeats.get((id(mask), n_rep))
    if known is not None:
        return known[1]
    repeated = mask.repeat(1, 1, n_rep, 1)
    repeats[(id(mask), n_rep)] = (mask, repeated)
    return repeated


def folded_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """An attention function for ``AttentionInterface``: (B, N, H, D) output, as transformers'
    ``sdpa_attention_forward`` returns."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, queries, dim = query.shape
    groups = key.shape[1]
    n_rep = heads // groups
    foldable = (
        n_rep > 1
        and queries > 1
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
    )
    if not foldable:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    folded = query.reshape(batch, groups, n_rep * queries, dim)
    mask = repeated_mask(attention_mask, n_rep)  # (B, 1, n_rep * N, L)
    output = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, scale=scaling
    )
    output = output.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous()  # (B, N, H, D)
    return output, None


def register_folded_sdpa() -> None:
    """Make ``FOLDED_SDPA`` an attention implementation transformers can dispatch to (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(FOLDED_SDPA, folded_sdpa_attention)
    AttentionMaskInterface.register(FOLDED_SDPA, sdpa_mask)


def fold_grouped_queries(model) -> bool:
    """Switch an SDPA model with grouped-query attention to ``folded_sdpa_attention``, in place;
    whether it was switched (False for eager attention, for models without grouped queries, and
    for one already switched)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_key_value_heads", None) or heads
    if not heads or heads == groups:
        return False
    register_folded_sdpa()
    model.set_attn_implementation(FOLDED_SDPA)
    return model.config._attn_implementation == FOLDED_SDPA
