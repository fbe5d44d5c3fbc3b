"""The one-Llama-layer drafter config that the EAGLE and EAGLE-3 engine formats share.

Both engines build the EAGLE drafters as a subclass of their Llama decoder layer (vLLM
``llama_eagle.py`` / ``llama_eagle3.py``, SGLang ``llama_eagle.py`` / ``llama_eagle3.py``), so the
checkpoint's config.json is the base Llama config with one layer. Written, it carries the geometry
engines build the drafter from; read back, it is what the base config is rebuilt from.
"""

from __future__ import annotations

from typing import Any

import torch

from draftheads.export.checkpoint import DRAFTHEADS_KEY, dtype_name
from draftheads.export.registry import FormatError
from draftheads.heads.base import DraftHead

# Fields of the draft layer's config that must equal the base model's.
LAYER_GEOMETRY = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "rms_norm_eps",
)
# Fields the EAGLE formats add to the Llama config; not part of the base config.
DRAFT_FIELDS = frozenset(
    {
        "architectures",
        "draft_vocab_size",
        "eagle_config",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual",
        "target_hidden_size",
        DRAFTHEADS_KEY,
        "torch_dtype",
        "dtype",
        "transformers_version",
    }
)
# The tensors SafeAILab's own EAGLE releases hold; their config says only "LlamaForCausalLM".
RELEASE_LAYOUT = ("fc.weight", "layers.0.self_attn.q_proj.weight")


def rope_fields(base_config) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters`` only; engines built on transformers 4.x read
    ``rope_theta`` / ``rope_scaling`` (a missing rope_theta silently becomes 10000)."""
    rope = dict(getattr(base_config, "rope_parameters", None) or {})
    fields: dict[str, Any] = {}
    theta = rope.get("rope_theta", getattr(base_config, "rope_theta", None))
    if theta is not None:
        fields["rope_theta"] = theta
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return fields


def engine_layer_config(config, head: DraftHead, architecture: str, **fields) -> dict[str, Any]:
    """``config`` (a transformers config) as engines read a drafter's: HF bookkeeping keys dropped,
    RoPE fields spelt out, the architecture and the head's dtype set, then ``fields``. The draft's
    lm_head is its own: SGLang uses embed_tokens as lm_head when ``tie_word_embeddings`` is true
    (llama_eagle3.py, llama_eagle.py)."""
    out = config.to_dict()
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id", "dtype", "torch_dtype"):
        out.pop(key, None)
    out.update(rope_fields(config))
    out.update(
        architectures=[architecture], tie_word_embeddings=False, torch_dtype=dtype_name(head), **fields
    )
    if isinstance(out.get("layer_types"), list) and "num_hidden_layers" in fields:
        # one entry per layer: transformers (>= 5) refuses a config whose layer_types is longer
        # than num_hidden_layers, and the base's list is as long as the base
        out["layer_types"] = out["layer_types"][: fields["num_hidden_layers"]]
    return out


def draft_layer_config(head: DraftHead, architecture: str, layer_config=None) -> dict[str, Any]:
    """The Llama config of the draft layer with one decoder layer: the geometry engines build the
    drafter from. ``layer_config``: the transformers config the head built its layer from (None:
    the base's)."""
    config = head.base_config if layer_config is None else layer_config
    return engine_layer_config(config, head, architecture, model_type=config.model_type, num_hidden_layers=1)


def require_llama(head: DraftHead, format_name: str) -> None:
    if head.base_config.model_type not in ("llama",):
        raise FormatError(
            f"format '{format_name}' builds the drafter as a Llama decoder layer; this head's base "
            f"model_type is '{head.base_config.model_type}' (only 'llama' is accepted by the engines' "
            f"LlamaForCausalLMEagle* loaders)"
        )


def require_llama_layer(layer_config, format_name: str) -> None:
    """Refuse a draft layer that is not a Llama layer (``layer_config``: the config it was built
    from): the engines would load its weights into a Llama layer, or not at all."""
    if layer_config.model_type != "llama":
        raise FormatError(
            f"format '{format_name}' holds the drafter as a Llama decoder layer; this head's layer is "
            f"'{layer_config.model_type}' (train it with head.layer_architecture: llama, or use "
            "--format draftheads)"
        )


def require_engine_features(head: DraftHead, format_name: str) -> None:
    """Engines capture a drafter's features between decoder layers, before the base's final norm;
    hs[L] (HF ``hidden_states``' last entry) comes after it, so no capture point holds it."""
    last = head.base_spec.num_hidden_layers
    if last in head.feature_layers:
        raise FormatError(
            f"format '{format_name}': this head reads hs[{last}] (feature_layers "
            f"{list(head.feature_layers)}), the base's hidden state after its final norm; engines "
            f"capture hidden states between decoder layers (hs[0..{last - 1}] and the last layer's "
            "unnormed output), so they would feed the head other values. Use --format draftheads."
        )


def base_fields_from_layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The base-config fields in a draft layer's config (its ``model_type`` included)."""
    return {k: v for k, v in config.items() if k not in DRAFT_FIELDS}


def release_fc_inputs(tensors: dict[str, torch.Tensor]) -> int | None:
    """For a SafeAILab release layout: how many hidden states ``fc`` reads (2 for EAGLE-1: the
    embedding and the feature; 3 for EAGLE-3's three layers); None for any other layout."""
    if not all(name in tensors for name in RELEASE_LAYOUT):
        return None
    fc = tensors["fc.weight"]
    return fc.shape[1] // fc.shape[0]
