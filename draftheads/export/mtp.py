"""The ``mtp-deepseek`` engine format: DeepSeek-V3 MTP layers ``model.layers.{L+k}.*``
(vllm/model_executor/models/deepseek_mtp.py), written only.

The engines build these layers as DeepseekV2DecoderLayer (MLA attention, MoE) and read them from
the target checkpoint itself, so only ``deepseek_v3`` bases qualify and the shard has to be added to
the base checkpoint (and its index).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.export.checkpoint import (
    DRAFTHEADS_KEY,
    frozen_weight,
    head_metadata,
    save_tensors,
    strip_prefix,
    write_config,
)
from draftheads.export.registry import ExportOptions, FormatError, register_writer
from draftheads.heads.base import DraftHead

MTP_BASE_TYPES = ("deepseek_v3",)  # DeepSeekMTP builds DeepseekV2DecoderLayer (deepseek_mtp.py)
MTP_WEIGHTS_NAME = "model-mtp.safetensors"


def _always(head: DraftHead) -> bool:
    return True


@register_writer(
    "mtp-deepseek",
    ("mtp",),
    "vLLM / SGLang DeepSeek-V3 MTP (deepseek_v3 bases only)",
    needs_base_weights=_always,
)
def write_mtp_deepseek(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    model_type = head.base_config.model_type
    if model_type not in MTP_BASE_TYPES:
        raise FormatError(
            f"format 'mtp-deepseek' writes DeepSeek-V3 MTP layers, which vLLM/SGLang build as DeepSeek-V2/V3 "
            f"decoder layers (MLA attention, MoE; vllm deepseek_mtp.py); this head's base model_type is "
            f"'{model_type}', accepted: {', '.join(MTP_BASE_TYPES)}. Use --format draftheads for this head."
        )
    state = head.head_state_dict()
    first = head.base_spec.num_hidden_layers
    depth = head.num_draft_steps
    tensors: dict[str, torch.Tensor] = {}
    for index in range(depth):
        source, target = f"modules.{index}.", f"model.layers.{first + index}."
        module = strip_prefix(state, source)
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            tensors[target + name] = module[name]
        for name, value in strip_prefix(module, "layer.").items():
            tensors[target + name] = value
        if "norm.weight" not in module:
            raise FormatError(f"mtp head has no modules.{index}.norm.weight to write as shared_head.norm")
        tensors[target + "shared_head.norm.weight"] = module["norm.weight"]
        tensors[target + "shared_head.head.weight"] = frozen_weight(head, "lm_head")
    # vLLM loads embed_tokens from the first MTP layer only (deepseek_mtp.py load_weights).
    tensors[f"model.layers.{first}.embed_tokens.weight"] = frozen_weight(head, "embed")
    config = head.base_config.to_dict()
    config.pop("_name_or_path", None)
    config["num_nextn_predict_layers"] = depth
    config[DRAFTHEADS_KEY] = head_metadata(head)
    save_tensors(tensors, directory / MTP_WEIGHTS_NAME)
    return write_config(config, directory)
