"""What the autoregressive heads borrow from the base architecture, and their attention masks.

Draft layers are instances of the base model's *own* decoder-layer, rotary-embedding and RMSNorm
classes, looked up by ``config.model_type`` in ``ARCHITECTURES`` (never a copied modeling file: a
fork breaks with every transformers release, as SafeAILab/EAGLE issue #278 shows). An architecture
is listed here once its decoder layer has been checked to take ``(hidden_states, attention_mask,
position_ids, the KV cache (``draftheads.compat.cache_kwargs``), use_cache,
position_embeddings=(cos, sin))`` and to update a ``DynamicCache`` through
``cache.update(keys, values, layer_idx)`` (transformers 5.23 and 5.24). Heads that run a layer's
parts one by one (EAGLE-3's midlayer, DFlash) combine them with ``add_attention`` and
``add_feed_forward``, which follow the architecture's norm layout.

Draft layers are full-attention layers: the masks the heads build see the whole prefix, with no
sliding window (Gemma 3 interleaves sliding-window and full layers; ``Architecture.draft_layer_type``
pins the type its draft layers are built as).

Masks are additive float tensors (0 = attend, dtype-min = masked) of shape (B, 1, Q, K), the form
``sdpa`` and ``eager`` attention take and tree verification uses too (``draftheads.infer.tree``).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from draftheads.heads.ttt_attention import DRAFT_SDPA, register_draft_sdpa


@dataclass(frozen=True)
class Architecture:
    """Where a base architecture's building blocks live in transformers."""

    module: str  # the modeling module, imported lazily
    prefix: str  # class-name prefix: {prefix}DecoderLayer, {prefix}RotaryEmbedding, {prefix}RMSNorm
    # Gemma 2/3 layers norm each sublayer's output as well as its input ("sandwich" norms:
    # post_attention_layernorm on the attention output, pre_/post_feedforward_layernorm around the
    # MLP); in Llama-style layers post_attention_layernorm is the MLP's input norm.
    sandwich_norms: bool = False
    # Its RMSNorm scales by norm_offset + weight (Gemma: 1 + weight, the weight initialised to 0).
    norm_offset: float = 0.0
    # The attention type draft layers are built as (every entry of their config's layer_types);
    # None: the config's types as they are.
    draft_layer_type: str | None = None
    # Its rotary embedding holds one table per attention type and is called with the type (Gemma 3:
    # rope_theta 1e6 for full attention, 1e4 for sliding); draft layers use draft_layer_type's.
    typed_rotary: bool = False

    def component(self, suffix: str) -> type[nn.Module]:
        return getattr(importlib.import_module(self.module), f"{self.prefix}{suffix}")


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": Architecture("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": Architecture("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": Architecture("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    # Gemma 3 text models (model_type gemma3_text, Gemma3ForCausalLM): q/k norms inside the attention,
    # scores scaled by query_pre_attn_scalar**-0.5, embeddings by sqrt(hidden_size) inside the
    # embedding module (Gemma3TextScaledWordEmbedding, so a head reusing it gets the same scale).
    "gemma3_text": Architecture(
        "transformers.models.gemma3.modeling_gemma3",
        "Gemma3",
        sandwich_norms=True,
        norm_offset=1.0,
        draft_layer_type="full_attention",
        typed_rotary=True,
    ),
}


def architecture(model_type: str) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"base model_type '{model_type}' has no registered decoder layer for draft heads; "
            f"supported: {', '.join(sorted(ARCHITECTURES))} (add it to draftheads.heads.layers.ARCHITECTURES)"
        )
    return ARCHITECTURES[model_type]


def draft_layer_config(base_config, **overrides):
    """A copy of the base config for building draft layers (attention pinned to ``DRAFT_SDPA``),
    with ``overrides`` (e.g. ``intermediate_size``) set on it.

    The drafter always runs SDPA: it takes 4D float masks (flash-attention-2 does not) and gives
    the same numbers whether a head was built from a live model or loaded from disk (a loaded
    config carries no attention implementation, which transformers would otherwise treat as
    eager). ``DRAFT_SDPA`` is SDPA under a registered name that adds training-time test's linear
    attention (``draftheads.heads.ttt_attention``)."""
    register_draft_sdpa()
    config = copy.deepcopy(base_config)
    config._attn_implementation = DRAFT_SDPA
    layer_type = architecture(config.model_type).draft_layer_type
    if layer_type is not None and getattr(config, "layer_types", None) is not None:
        config.layer_types = [layer_type] * len(config.layer_types)
    for name, value in overrides.items():
        if not hasattr(config, name):
            raise ValueError(f"draft layer override '{name}': the base config has no such field")
        setattr(config, name, value)
    return config


def draft_rope(base_config) -> dict:
    """The base's rope parameters; for an architecture with one set per attention type (Gemma 3),
    the set of the type its draft layers are built as."""
    arch = architecture(base_config.model_type)
    rope = dict(base_config.rope_parameters)
    return dict(rope[arch.draft_layer_type]) if arch.typed_rotary else rope


# Layouts a head may build its draft layers as instead of the base's own (``layer_architecture``),
# because engines build their drafters so whatever the target: vLLM llama_eagle3.py and llama.cpp
# src/models/eagle3.cpp EAGLE-3 drafters as Llama layers, the DFlash releases, speculators and
# vLLM qwen3_dflash.py DFlash drafters as Qwen3 layers. Their MLPs are SiLU only (vLLM llama.py
# LlamaMLP and qwen2.py Qwen2MLP, which qwen3_dflash.py uses, refuse any other activation; llama.cpp
# eagle3.cpp builds LLM_FFN_SILU), so a layout's MLP is SiLU whatever the base's (Gemma: GELU).
LAYOUT_CONFIGS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config"}
LAYOUT_ACTIVATION = "silu"


def layout_config(base_config, layout: str):
    """A ``layout`` (``LAYOUT_CONFIGS``) config of the base's geometry: its width, heads, head_dim,
    vocabulary, norm epsilon and (draft-layer type's) rope, with a SiLU MLP."""
    import transformers

    config_class = getattr(transformers, LAYOUT_CONFIGS[layout])
    return config_class(
        vocab_size=base_config.vocab_size,
        hidden_size=base_config.hidden_size,
        intermediate_size=base_config.intermediate_size,
        num_hidden_layers=base_config.num_hidden_layers,
        num_attention_heads=base_config.num_attention_heads,
        num_key_value_heads=base_config.num_key_value_heads,
        head_dim=getattr(base_config, "head_dim", None)
        or base_config.hidden_size // base_config.num_attention_heads,
        hidden_act=LAYOUT_ACTIVATION,
        max_position_embeddings=base_config.max_position_embeddings,
        rms_norm_eps=base_config.rms_norm_eps,
        rope_parameters=draft_rope(base_config),
        attention_bias=False,
        tie_word_embeddings=False,
    )


def build_decoder_layer(base_config, layer_idx: int = 0, **overrides) -> nn.Module:
    """One decoder layer of the base architecture, its config changed by ``overrides``;
    ``layer_idx`` is its slot in the draft cache."""
    config = draft_layer_config(base_config, **overrides)
    return architecture(config.model_type).component("DecoderLayer")(config, layer_idx)


class DraftRotary(nn.Module):
    """The base architecture's rotary embedding, ``rotary(x, position_ids) -> (cos, sin)``, whose
    frequency tables (``*inv_freq`` buffers) stay fp32 through every cast of the head: ``.to(bf16)``,
    ``.half()`` and DeepSpeed's ``module.bfloat16()`` move them to the new device but keep their
    fp32 values. Rounded to bf16, the frequencies of a rope_theta 5e5 base are off by up to 0.33%,
    over a radian at position 2,000 for some of them; the base and every engine keep them fp32, so
    a head would be trained and served on positions the base never uses. A typed rotary
    (``Architecture.typed_rotary``) is called with the draft layers' attention type."""

    def __init__(self, rotary: nn.Module, layer_type: str | None = None):
        super().__init__()
        self.rotary = rotary
        self.layer_type = layer_type
        # A plain dict, not buffers: casts and moves leave these fp32 originals alone.
        self.fp32_tables = {
            name: buffer.detach().float().clone() for name, buffer in self.frequency_buffers()
        }

    def frequency_buffers(self):
        """(qualified name, tensor) of every rotary frequency table."""
        return [(name, buffer) for name, buffer in self.rotary.named_buffers() if name.endswith("inv_freq")]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name, buffer in self.frequency_buffers():
            if buffer.dtype != torch.float32:
                owner_name, _, buffer_name = name.rpartition(".")
                owner = self.rotary.get_submodule(owner_name) if owner_name else self.rotary
                owner._buffers[buffer_name] = self.fp32_tables[name].to(buffer.device)
        return self

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self.layer_type is None:
            return self.rotary(x, position_ids)
        return self.rotary(x, position_ids, self.layer_type)


def build_rotary_embedding(base_config) -> nn.Module:
    """The base architecture's rotary embedding, fp32 tables kept (``DraftRotary``):
    ``rotary(x, position_ids) -> (cos, sin)``."""
    config = draft_layer_config(base_config)
    arch = architecture(config.model_type)
    rotary = arch.component("RotaryEmbedding")(config)
    return DraftRotary(rotary, arch.draft_layer_type if arch.typed_rotary else None)


def build_rms_norm(base_config, size: int | None = None) -> nn.Module:
    """The base architecture's RMSNorm over ``size`` (default hidden_size) features."""
    norm_class = architecture(base_config.model_type).component("RMSNorm")
    return norm_class(size or base_config.hidden_size, eps=base_config.rms_norm_eps)


def norm_weight_for(weight: torch.Tensor, source_type: str, target_type: str) -> torch.Tensor:
    """An RMSNorm weight of architecture ``source_type`` as the weight that scales the same in a
    norm of ``target_type`` (a Gemma norm's w is a Llama-style norm's 1 + w)."""
    offset = architecture(source_type).norm_offset - architecture(target_type).norm_offset
    return weight + offset if offset else weight


def add_attention(
    layer: nn.Module, model_type: str, hidden: torch.Tensor, attended: torch.Tensor
) -> torch.Tensor:
    """The residual after a decoder layer's attention: (B, T, h) ``hidden`` + its (B, T, h)
    attention output ``attended``, normed first where the architecture norms sublayer outputs."""
    if architecture(model_type).sandwich_norms:
        attended = layer.post_attention_layernorm(attended)
    return hidden + attended


def add_feed_forward(layer: nn.Module, model_type: str, hidden: torch.Tensor) -> torch.Tensor:
    """The residual after a decoder layer's MLP, (B, T, h) -> (B, T, h), with the architecture's norms."""
    if architecture(model_type).sandwich_norms:
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def replace_linear_input(linear: nn.Linear, in_features: int) -> nn.Linear:
    """A fresh projection like ``linear`` (same output size, bias, dtype, device) reading ``in_features``."""
    weight = linear.weight
    return nn.Linear(
        in_features,
        linear.out_features,
        bias=linear.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )


def shift_left(token_ids: torch.Tensor, count: int) -> torch.Tensor:
    """(B, T) -> (B, T): row i holds token i + count; rows past the end hold 0 (their outputs are
    never supervised)."""
    shifted = torch.zeros_like(token_ids)
    if count < token_ids.shape[1]:
        shifted[:, : token_ids.shape[1] - count] = token_ids[:, count:]
    return shifted


# ---- masks ----------------------------------------------------------------------------------------


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (..., Q, K) "may attend" -> additive float mask of the same shape."""
    zeros = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zeros, torch.finfo(dtype).min)


def padded_causal_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """(B, 1, T, T) causal mask over a training batch whose padding is 0 in ``attention_mask`` (B, T).

    Every query also sees itself, so a padding row is never fully masked (its output is unused).
    """
    positions = torch.arange(length, device=device)
    allowed = positions[None, :] <= positions[:, None]  # (T, T)
    allowed = allowed[None, None].expand(batch, 1, length, length)
    if attention_mask is not None:
        key_valid = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]  # (B, 1, 1, T)
        allowed = (allowed & key_valid) | torch.eye(length, dtype=torch.bool, device=device)
    return additive_mask(allowed, dtype)


def prefix_causal_mask(batch: int, past_length: int, length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(B, 1, T, past + T): the whole cached prefix is visible, the T new positions causally."""
    new = torch.arange(length, device=device)
    causal = new[None, :] <= new[:, None]  # (T, T)
    prefix = torch.ones(length, past_length, dtype=torch.bool, device=device)
    allowed = torch.cat([prefix, causal], dim=1)[None, None].expand(batch, 1, length, past_length + length)
    return additive_mask(allowed, dtype)


def prefix_and_self_mask(
    batch: int, past_length: int, length: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """(B, 1, N, past + N): each of N new queries sees the cached prefix and only itself."""
    prefix = torch.ones(length, past_length, dtype=torch.bool, device=device)
    own = torch.eye(length, dtype=torch.bool, device=device)
    allowed = torch.cat([prefix, own], dim=1)[None, None].expand(batch, 1, length, past_length + length)
    return additive_mask(allowed, dtype)
