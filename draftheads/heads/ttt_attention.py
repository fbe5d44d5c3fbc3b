"""Training-time-test attention whose work and memory grow linearly with the unrolled steps.

In EAGLE-3's training-time test (arXiv 2503.01840, section 3.3) step j of drafter row i attends to
the step-0 rows up to i (the features a draft node's prefix cache holds) and to row i's own states
of steps 1..j (its ancestors), nothing else. The draft cache holds the keys as
``[step 0 (T) | step 1 (R_1) | ... | step j (R_j)]``; with one dense additive mask over all of them a
step costs R_j x (T + R_1 + ... + R_j) scores, 28 T^2 over 7 steps for T rows, and the mask itself
grows with every step. Only the step-0 block is a matrix; each later block is a diagonal (slot s
sees key slot s), so here a step scores its queries against the step-0 keys (R_j x T) and takes
one dot product per earlier step and query (R_j x j): about 7 T^2 over 7 steps, the same as
SpecForge's per-step diagonal (sgl-project/SpecForge, ``specforge/modeling/draft/llama3_eagle.py``).

The softmax runs over the step-0 scores and the diagonal ones together, in fp32, so the result is
the dense masked attention's (``tests/heads/test_ttt_attention.py`` checks outputs and gradients
against it). Queries go in chunks whose (chunk, T) scores per head stay near ``CHUNK_SCORES``
elements; with gradients on, each chunk is recomputed in the backward pass instead of keeping its
scores and probabilities, so a step holds O(R_j x T) scores at a time, not all of them.

The draft layers reach this through transformers' attention registry (``AttentionInterface``, the
documented way to plug in an attention function without touching a modeling file): their configs
name ``DRAFT_SDPA``, which runs this for a ``StepMask`` and transformers' SDPA for a tensor mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

DRAFT_SDPA = "draftheads_draft_sdpa"
# Scores per query chunk, over all heads and batch rows: 2^26 fp32 elements, 256 MiB; the chunk's
# probabilities and the score's gradient take as much again in the backward pass.
CHUNK_SCORES = 2**26


@dataclass(frozen=True)
class StepMask:
    """What the queries of training-time-test step j >= 1 see.

    prefix: (B, 1, R_j, T) additive mask over the step-0 keys (0 = attend, dtype-min = masked).
    widths: (R_1, ..., R_j), the rows of steps 1..j, whose keys follow the step-0 keys in the cache
        in that order; widths never grow, and query slot s sees key slot s of each of them.
    """

    prefix: torch.Tensor
    widths: tuple[int, ...]

    def to(self, dtype: torch.dtype) -> StepMask:
        return StepMask(self.prefix.to(dtype), self.widths)


class StepKeys:
    """The draft cache of one training-time-test step, sharing no state with other steps.

    ``update`` (what a transformers attention layer calls) returns the earlier steps' keys and
    values, ``earlier[layer_idx]``, with this step's appended: what a cache extended step by step
    would hold, ``[step 0 | step 1 | ... | step j]``; the result stays in ``held``. What a step
    reads is then fixed by its inputs, so the step can be recomputed in the backward pass
    (activation checkpointing), where a cache extended in place would by then hold every later
    step's keys as well.
    """

    def __init__(self, earlier: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()):
        self.earlier = earlier
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx < len(self.earlier):
            past_key, past_value = self.earlier[layer_idx]
            key, value = torch.cat([past_key, key], dim=-2), torch.cat([past_value, value], dim=-2)
        self.held[layer_idx] = (key, value)
        return key, value

    def layers(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every layer's keys and values after this step, by layer index."""
        return tuple(self.held[index] for index in sorted(self.held))


def _chunk_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    prefix_mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of C query slots, heads grouped by their key/value head (G query heads each).

    query (B, Hkv, G, C, D); prefix keys/values (B, Hkv, T, D); own keys/values (B, Hkv, C, j, D),
    slot c's keys of steps 1..j; prefix_mask (B, 1, C, T) additive. Returns (B, Hkv, G, C, D).
    """
    prefix_scores = torch.einsum("bkgcd,bktd->bkgct", query, prefix_keys).float() * scaling
    prefix_scores = prefix_scores + prefix_mask[:, :, None].float()  # (B, Hkv, G, C, T)
    own_scores = torch.einsum("bkgcd,bkcjd->bkgcj", query, own_keys).float() * scaling  # (B, Hkv, G, C, j)
    probabilities = torch.softmax(torch.cat([prefix_scores, own_scores], dim=-1), dim=-1)
    probabilities = probabilities.to(query.dtype)
    length = prefix_keys.shape[2]
    output = torch.einsum("bkgct,bktd->bkgcd", probabilities[..., :length], prefix_values)
    return output + torch.einsum("bkgcj,bkcjd->bkgcd", probabilities[..., length:], own_values)


def step_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: StepMask, scaling: float
) -> torch.Tensor:
    """Attention of one training-time-test step j >= 1.

    query (B, H, R_j, D); key and value (B, Hkv, T + R_1 + ... + R_j, D), the draft cache's keys in
    step order. Returns (B, R_j, H, D), as transformers' attention functions do.
    """
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    length = key.shape[2] - sum(mask.widths)
    starts = [length + sum(mask.widths[:index]) for index in range(len(mask.widths))]
    # slot s's own key of each step: (B, Hkv, R_j, j, D)
    own_keys = torch.stack([key[:, :, start : start + queries] for start in starts], dim=3)
    own_values = torch.stack([value[:, :, start : start + queries] for start in starts], dim=3)
    grouped = query.view(batch, kv_heads, heads // kv_heads, queries, dim)
    prefix_keys, prefix_values = key[:, :, :length], value[:, :, :length]
    chunk = max(1, CHUNK_SCORES // max(1, batch * heads * length))
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outputs = []
    for start in range(0, queries, chunk):
        rows = slice(start, start + chunk)
        inputs = (
            grouped[:, :, :, rows],
            prefix_keys,
            prefix_values,
            own_keys[:, :, rows],
            own_values[:, :, rows],
            mask.prefix[:, :, rows],
            scaling,
        )
        if recompute:
            outputs.append(checkpoint(_chunk_attention, *inputs, use_reentrant=False))
        else:
            outputs.append(_chunk_attention(*inputs))
    output = torch.cat(outputs, dim=3).view(batch, heads, queries, dim)
    return output.transpose(1, 2).contiguous()


def draft_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The draft layers' attention function (``AttentionInterface``): ``step_attention`` for a
    ``StepMask``, transformers' SDPA for anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, StepMask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    unsupported = {
        "dropout": dropout or None,
        "softcap": kwargs.get("softcap"),
        "sliding_window": kwargs.get("sliding_window"),
    }
    if any(value is not None for value in unsupported.values()):
        raise ValueError(
            "training-time-test attention supports full attention without dropout or soft-capping; "
            f"the draft layer asked for {unsupported}"
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return step_attention(query, key, value, attention_mask, scale), None


def register_draft_sdpa() -> None:
    """Make ``DRAFT_SDPA`` an attention implementation transformers can dispatch to (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DRAFT_SDPA, draft_sdpa_attention)
    AttentionMaskInterface.register(DRAFT_SDPA, sdpa_mask)
