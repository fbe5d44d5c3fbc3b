"""EAGLE-1 engine formats: ``eagle`` (vLLM) and ``eagle-sglang`` (SGLang), written and read back.

- ``eagle``: vLLM ``EagleLlamaForCausalLM`` (vllm/model_executor/models/llama_eagle.py): ``fc`` has
  NO bias there, so a head whose fc.bias is non-zero is refused (use ``eagle-sglang``).
- ``eagle-sglang``: SGLang ``LlamaForCausalLMEagle`` (sglang/srt/models/llama_eagle.py): ``fc`` with
  bias.

Both replace the first layer's input_layernorm by identity and load no weight for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.export.checkpoint import (
    DRAFTHEADS_KEY,
    head_metadata,
    save_tensors,
    strip_prefix,
    write_config,
)
from draftheads.export.draft_layer import (
    LAYER_GEOMETRY,
    base_fields_from_layer_config,
    draft_layer_config,
    release_fc_inputs,
    require_llama,
)
from draftheads.export.registry import (
    EngineReader,
    ExportOptions,
    FormatError,
    register_reader,
    register_writer,
)
from draftheads.heads.base import WEIGHTS_NAME, DraftHead

ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")


# ---- writers ----------------------------------------------------------------------------------


def eagle_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """The head's tensors in the engines' names (``fc.bias`` included if the head has one)."""
    state = head.head_state_dict()
    tensors = {f"layers.0.{k}": v for k, v in strip_prefix(state, "layer.").items()}
    tensors.pop("layers.0.input_layernorm.weight", None)
    tensors["fc.weight"] = state["fc.weight"]
    if "fc.bias" in state:
        tensors["fc.bias"] = state["fc.bias"]
    return tensors


@register_writer("eagle", ("eagle",), "vLLM (EagleLlamaForCausalLM)")
def write_eagle(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_llama(head, "eagle")
    tensors = eagle_tensors(head)
    bias = tensors.pop("fc.bias", None)
    if bias is not None and bool(bias.abs().max() > 0):
        raise FormatError(
            "vLLM's EagleLlamaForCausalLM builds fc without a bias "
            "(vllm/model_executor/models/llama_eagle.py), "
            f"but this head's fc.bias is non-zero (max |b| = {float(bias.abs().max()):.3g}); "
            "dropping it would change the drafts. Export with --format eagle-sglang (SGLang keeps the bias) "
            "or train with a bias-free fc (head.fc_bias=false)."
        )
    config = draft_layer_config(head, "EagleLlamaForCausalLM")
    config[DRAFTHEADS_KEY] = head_metadata(head)
    save_tensors(tensors, directory / WEIGHTS_NAME)
    return write_config(config, directory)


@register_writer("eagle-sglang", ("eagle",), "SGLang (LlamaForCausalLMEagle)")
def write_eagle_sglang(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_llama(head, "eagle-sglang")
    tensors = eagle_tensors(head)
    if "fc.bias" not in tensors:
        # SGLang's fc always has a bias (nn.Linear default); without one in the file it keeps its
        # random initialisation (sglang issue #5773), so write explicit zeros.
        tensors["fc.bias"] = torch.zeros(tensors["fc.weight"].shape[0], dtype=tensors["fc.weight"].dtype)
    config = draft_layer_config(head, "LlamaForCausalLMEagle")
    config[DRAFTHEADS_KEY] = head_metadata(head)
    save_tensors(tensors, directory / WEIGHTS_NAME)
    return write_config(config, directory)


# ---- reader -----------------------------------------------------------------------------------


@register_reader
class EagleReader(EngineReader):
    """Both engines' EAGLE-1 checkpoints, and SafeAILab EAGLE-1 releases whose config says only
    ``LlamaForCausalLM`` (recognised by ``fc`` reading two hidden states)."""

    name = "eagle"
    kind = "eagle"
    description = f"eagle ({', '.join(ARCHITECTURES)})"
    geometry_fields = LAYER_GEOMETRY

    def recognises(self, saved):
        return any(architecture in ARCHITECTURES for architecture in saved.get("architectures") or [])

    def recognises_layout(self, tensors):
        inputs = release_fc_inputs(tensors)
        return inputs is not None and inputs != 3

    def base_config_fields(self, config):
        return base_fields_from_layer_config(config)

    def head_state(self, tensors, config, where):
        out: dict[str, torch.Tensor] = {}
        notes: list[str] = []
        for name, value in tensors.items():
            prefix = next((p for p in ("layers.0.", "model.layers.0.") if name.startswith(p)), None)
            if prefix is not None:
                if not name.endswith("input_layernorm.weight"):
                    out["layer." + name[len(prefix) :]] = value
            elif name.removeprefix("model.") in ("fc.weight", "fc.bias"):
                out[name.removeprefix("model.")] = value
            elif "embed_tokens" in name or name.startswith("lm_head"):
                notes.append(f"ignored {name} (the base model's embedding and lm_head are used)")
            else:
                raise FormatError(f"{where}: tensor '{name}' has no place in an EAGLE-1 head")
        if "fc.bias" not in out:  # vLLM-layout checkpoints have no fc bias: an exact zero
            out["fc.bias"] = torch.zeros(out["fc.weight"].shape[0], dtype=out["fc.weight"].dtype)
        return out, notes

    def fit_state(self, state, head, base_model, where):
        if "fc.bias" not in head.state_dict():  # trained with fc_bias: false; the file has none
            state.pop("fc.bias", None)
        return state
