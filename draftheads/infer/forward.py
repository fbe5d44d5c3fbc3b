"""The verification forward: every node of a candidate tree through the unmodified Hugging Face
model in one call, with a 4D additive attention mask (one per attention type when sliding-window
and full layers mix: ``window.py``) and explicit positions (``tree.py``), and the checks that
refuse inputs transformers would silently misread."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftheads.attention import mask_repeats_shared
from draftheads.base_model import SUPPORTED_ATTENTION
from draftheads.compat import cache_kwargs
from draftheads.infer.cache import new_cache
from draftheads.infer.tree import TreeTopology, rows_attention_mask, rows_position_ids
from draftheads.infer.window import layer_masks, layer_types

__all__ = [
    "SUPPORTED_ATTENTION",
    "TreeInputError",
    "check_tree_inputs",
    "prefill_forward",
    "rows_forward",
    "tree_forward",
]


class TreeInputError(ValueError):
    """Inputs that would make the HF model silently compute something other than tree attention."""


def check_tree_inputs(model, input_ids, attention_mask, position_ids, past_length: int) -> None:
    """Refuse the inputs that transformers 5.x accepts but silently misreads: a 2D mask
    (taken as padding), a bool mask (misread by eager attention), missing position_ids (positions
    then run past the tree's depth), and attention kernels that ignore or reject a 4D mask.
    ``attention_mask`` is a 4D tensor, or {layer type: 4D tensor} (``window.layer_masks``)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise TreeInputError(
            f"attn_implementation '{implementation}' cannot verify a tree (it needs a 4D float mask); "
            f"load the base model with attn_implementation in {SUPPORTED_ATTENTION}"
        )
    if isinstance(attention_mask, dict):
        expected_types = set(layer_types(model.config))
        if set(attention_mask) != expected_types:
            raise TreeInputError(
                f"attention_mask has masks for {sorted(attention_mask)}, "
                f"the layers are {sorted(expected_types)}"
            )
        for mask in attention_mask.values():
            _check_mask(model, input_ids, mask, past_length)
    else:
        _check_mask(model, input_ids, attention_mask, past_length)
    batch, length = input_ids.shape
    if position_ids is None or tuple(position_ids.shape) != (batch, length):
        shape = None if position_ids is None else tuple(position_ids.shape)
        raise TreeInputError(f"position_ids must be given with shape {(batch, length)}, got {shape}")


def _check_mask(model, input_ids, attention_mask, past_length: int) -> None:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        shape = getattr(attention_mask, "shape", None)
        raise TreeInputError(f"attention_mask must be a 4D tensor (B, 1, N, past + N), got shape {shape}")
    batch, length = input_ids.shape
    expected = (batch, 1, length, past_length + length)
    if tuple(attention_mask.shape) != expected:
        raise TreeInputError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {expected}")
    if attention_mask.dtype != model.dtype:
        raise TreeInputError(
            f"attention_mask must be additive float in the model dtype {model.dtype} "
            f"(0 attend, finfo.min masked), got {attention_mask.dtype}"
        )
    masked = torch.finfo(model.dtype).min
    if not bool(((attention_mask == 0) | (attention_mask == masked)).all()):
        raise TreeInputError("attention_mask values must be 0 (attend) or finfo(dtype).min (masked)")


def tree_forward(model, cache, tokens: torch.Tensor, topology: TreeTopology, hidden_layers: Sequence[int]):
    """Verify a tree in one forward of the HF model; the cache gains the tree's N entries.

    Args:
        tokens: (N,) node tokens (padding included), node 0 the root.
        hidden_layers: the ``hidden_states`` indices the head reads. transformers 5.x records hidden
            states with forward hooks and, given a list of indices, keeps only those (the others
            come back as None), so asking for them costs references, not copies.
    Returns:
        The model output: ``logits`` (1, N, V) and ``hidden_states`` (the selected entries (1, N, h)).
    """
    slots = torch.ones(1, cache.get_seq_length(), dtype=torch.bool)
    return rows_forward(model, cache, [tokens], [topology], slots, hidden_layers)


def rows_forward(
    model,
    cache,
    tokens: Sequence[torch.Tensor],
    topologies: Sequence[TreeTopology],
    slots: torch.Tensor,
    hidden_layers: Sequence[int],
):
    """Verify one tree per row of a batch in one forward; every cache row gains ``size`` entries.

    Args:
        tokens: per row, (N_b,) node tokens (padding included), node 0 the row's root.
        topologies: per row, its tree (``topologies[b].size == N_b``).
        slots: (B, L) bool, the cache slots holding each row's entries (``cache.keep_accepted_rows``;
            the others are free and masked: ``tree.rows_attention_mask``); a row's root sits at
            the position after its entries.
    Returns:
        The model output: ``logits`` (B, size, V) with size = max N_b (row b's first N_b are its
        tree's) and the selected ``hidden_states`` (B, size, h).
    """
    cache_length = cache.get_seq_length()
    if slots.shape[1] != cache_length:
        raise ValueError(f"slots for {slots.shape[1]} cache entries, but the cache holds {cache_length}")
    device = model.device
    size = max(t.size for t in topologies)
    input_ids = torch.stack([torch.cat([t, t[:1].expand(size - t.numel())]) for t in tokens]).to(device)
    tree_mask = rows_attention_mask(topologies, slots, size, model.dtype, device)
    lengths = slots.sum(dim=1).tolist()  # each row's entries: its root's position
    position_ids = rows_position_ids(topologies, lengths, size, device)  # (B, N)
    # sliding-window layers see the tree mask with their window applied (``window.py``)
    attention_mask = layer_masks(model.config, tree_mask, slots, position_ids)
    check_tree_inputs(model, input_ids, attention_mask, position_ids, cache_length)
    with mask_repeats_shared():  # every layer gets this mask: a folded model repeats it once
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            use_cache=True,
            output_hidden_states=list(hidden_layers),
        )


def prefill_forward(model, input_ids: torch.Tensor, hidden_layers: Sequence[int]):
    """The prompt (1, T) through the HF model into a new cache: ``(cache, output)`` with the last
    position's logits (1, 1, V) and the ``hidden_states`` entries a drafter reads."""
    cache = new_cache(model)
    output = model(
        input_ids=input_ids,
        **cache_kwargs(cache),
        use_cache=True,
        output_hidden_states=list(hidden_layers),
        logits_to_keep=1,
    )
    return cache, output


def prefill_rows(model, prompts: Sequence[torch.Tensor], hidden_layers: Sequence[int]):
    """Prompts of different lengths (each (T_b,)) through the HF model in one forward, right-padded,
    so every cache row holds its prompt left-aligned (``rows_forward``'s layout).

    Returns ``(cache, last_logits, hidden_states)``: the logits at each row's last prompt token
    (B, V) and the selected ``hidden_states`` entries (B, max T, h) (a row's positions after its
    length are padding)."""
    if len(prompts) == 1:
        cache, output = prefill_forward(model, prompts[0][None], hidden_layers)
        return cache, output.logits[:, -1], output.hidden_states
    lengths = torch.tensor([p.numel() for p in prompts])
    longest = int(lengths.max())
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : prompt.numel()] = prompt
    attention_mask = (torch.arange(longest)[None] < lengths[:, None]).long()  # (B, T) 1 = real token
    last = lengths - 1
    keep = torch.unique(last)  # ascending: the sequence positions whose logits are needed
    cache = new_cache(model)
    with mask_repeats_shared():
        output = model(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            **cache_kwargs(cache),
            use_cache=True,
            output_hidden_states=list(hidden_layers),
            logits_to_keep=keep.to(model.device),
        )
    column = torch.searchsorted(keep, last)  # each row's last position among the kept ones
    logits = output.logits[torch.arange(len(prompts)), column.to(output.logits.device)]  # (B, V)
    return cache, logits, output.hidden_states
