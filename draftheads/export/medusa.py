"""The ``medusa-vllm`` engine format: vLLM ``MedusaModel`` (vllm/model_executor/models/medusa.py,
vllm/transformers_utils/configs/medusa.py), written and read back.

Tensors ``blocks.{h}.layers.{l}.{weight,bias}`` (a bias iff ``medusa_fc_bias``) and
``lm_heads.{h}.weight`` (one per head unless ``original_lm_head``); config ``num_heads``,
``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.export.checkpoint import (
    DRAFTHEADS_KEY,
    dtype_name,
    frozen_weight,
    head_metadata,
    save_tensors,
    write_config,
)
from draftheads.export.registry import (
    EngineReader,
    ExportOptions,
    FormatError,
    register_reader,
    register_writer,
)
from draftheads.heads.base import WEIGHTS_NAME, DraftHead, HeadMismatchError


def _shares_base_lm_head(head: DraftHead) -> bool:
    return bool(getattr(head.config, "shared_lm_head", False))


@register_writer("medusa-vllm", ("medusa",), "vLLM (MedusaModel)", needs_base_weights=_shares_base_lm_head)
def write_medusa_vllm(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    state = head.head_state_dict()
    num_heads = head.num_draft_steps
    num_layers = len({k.split(".")[3] for k in state if k.startswith("heads.0.blocks.")})
    has_bias = any(k.endswith(".linear.bias") for k in state)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(num_heads):
        for layer in range(num_layers):
            prefix = f"heads.{index}.blocks.{layer}.linear."
            tensors[f"blocks.{index}.layers.{layer}.weight"] = state[prefix + "weight"]
            if has_bias:
                tensors[f"blocks.{index}.layers.{layer}.bias"] = state[prefix + "bias"]
        # vLLM's MedusaModel has one lm_head per head (unless original_lm_head); a head sharing the
        # base lm_head gets that weight materialised per head.
        own = state.get(f"heads.{index}.lm_head.weight")
        tensors[f"lm_heads.{index}.weight"] = own if own is not None else frozen_weight(head, "lm_head")
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "hidden_size": head.base_spec.hidden_size,
        "vocab_size": head.base_spec.vocab_size,
        "truncated_vocab_size": head.base_spec.vocab_size,
        "medusa_fc_bias": has_bias,
        "original_lm_head": False,
        "torch_dtype": dtype_name(head),
        DRAFTHEADS_KEY: head_metadata(head),
    }
    save_tensors(tensors, directory / WEIGHTS_NAME)
    return write_config(config, directory)


@register_reader
class MedusaVllmReader(EngineReader):
    """vLLM ``MedusaModel`` checkpoints. The config names no base ``model_type``: without our
    metadata the base is taken to be a Llama."""

    name = "medusa-vllm"
    kind = "medusa"
    description = "medusa-vllm (MedusaModel)"

    def recognises(self, saved):
        return saved.get("model_type") == "medusa" or "MedusaModel" in (saved.get("architectures") or [])

    def head_config_values(self, config, base_num_layers):
        return {
            "num_heads": config["num_heads"],
            "num_layers": config["num_hidden_layers"],
            "shared_lm_head": False,
        }

    def head_state(self, tensors, config, where):
        if (
            config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"]
            or "token_map" in tensors
        ):
            raise FormatError(f"{where}: truncated-vocabulary Medusa heads (token_map) are not supported")
        shared = tensors.get("lm_head.weight") if config.get("original_lm_head") else None
        out: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            parts = name.removeprefix("medusa_heads.").split(".")
            if parts[0] == "blocks" and parts[2] == "layers":  # blocks.{h}.layers.{l}.{weight,bias}
                out[f"heads.{parts[1]}.blocks.{parts[3]}.linear.{parts[4]}"] = value
            elif parts[0] == "lm_heads" and not config.get("original_lm_head"):
                out[f"heads.{parts[1]}.lm_head.weight"] = value
            elif parts[0] == "lm_heads" or name == "lm_head.weight":
                shared = value if shared is None else shared
            else:
                raise FormatError(f"{where}: tensor '{name}' has no place in a Medusa head")
        for index in range(config["num_heads"]):
            if shared is not None:  # original_lm_head: one lm_head for every head
                out[f"heads.{index}.lm_head.weight"] = shared
            for layer in range(config["num_hidden_layers"]):
                bias = f"heads.{index}.blocks.{layer}.linear.bias"
                if bias not in out:  # medusa_fc_bias false: the bias is exactly zero
                    out[bias] = torch.zeros(config["hidden_size"], dtype=out[bias[:-4] + "weight"].dtype)
        return out, []

    def fit_state(self, state, head, base_model, where):
        if not head.config.shared_lm_head:
            return state
        # Our export materialised the shared base lm_head per head; the head itself keeps none.
        copies = [state.pop(k) for k in sorted(state) if k.endswith(".lm_head.weight")]
        if base_model is not None:
            base_weight = base_model.get_output_embeddings().weight.detach().cpu()
            if any(not torch.equal(c.to(base_weight.dtype), base_weight) for c in copies):
                raise HeadMismatchError(
                    f"{where}: the lm_heads written for a shared-lm_head Medusa head differ from this base "
                    "model's lm_head"
                )
        return state
