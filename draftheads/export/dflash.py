"""DFlash engine formats, written and read back.

- ``dflash``: the layout of the DFlash releases (github.com/z-lab/dflash, ``DFlashDraftModel``),
  which SGLang (``--speculative-algorithm DFLASH``) and vLLM (``qwen3_dflash.py``) load: the Qwen3
  draft-layer config with ``num_hidden_layers`` = draft layers and a ``dflash_config`` holding
  ``block_size``, ``mask_token_id`` and ``target_layer_ids`` (decoder-layer ids whose *outputs* are
  fused: HF ``hidden_states`` index - 1; ``extract_context_feature`` reads ``hidden_states[id + 1]``).
- ``dflash-speculators``: vLLM's speculators config (``speculators_model_type: dflash``;
  vllm/transformers_utils/configs/speculators/algos.py ``update_dflash``, speculators
  ``models/dflash/config.py``): ``transformer_layer_config``, ``block_size``, ``mask_token_id`` and
  ``aux_hidden_state_layer_ids`` (HF ``hidden_states`` indices; vLLM derives
  ``target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids]`` from them).

Both hold the same tensors, named as our head names them (``fc``, ``hidden_norm``,
``layers.{i}.``, ``norm``); the base's embedding and lm_head are shared, not written. The engines
build Qwen3 draft layers (q/k norms) whatever the target, so a head is exportable only with
``layer_architecture: qwen3`` (or a Qwen3 base).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.base_model import hub_name
from draftheads.export.checkpoint import DRAFTHEADS_KEY, dtype_name, head_metadata, save_tensors, write_config
from draftheads.export.draft_layer import LAYER_GEOMETRY, engine_layer_config, require_engine_features
from draftheads.export.registry import (
    EngineReader,
    ExportOptions,
    FormatError,
    proposal_length,
    register_reader,
    register_writer,
)
from draftheads.heads.base import WEIGHTS_NAME, DraftHead

ARCHITECTURE = "DFlashDraftModel"
HEAD_TENSOR_PREFIXES = ("fc.", "hidden_norm.", "layers.", "norm.")


def require_qwen3_layers(head: DraftHead, format_name: str) -> None:
    if head.layer_config.model_type != "qwen3":
        raise FormatError(
            f"format '{format_name}' loads the drafter as Qwen3 decoder layers; this head's layers are "
            f"'{head.layer_config.model_type}' (train it with head.layer_architecture: qwen3, or use "
            "--format draftheads)"
        )


def layer_config_dict(head: DraftHead, architecture: str) -> dict[str, Any]:
    """The draft layers' Qwen3 config: the base geometry, ``num_hidden_layers`` = draft layers."""
    return engine_layer_config(
        head.layer_config, head, architecture, model_type="qwen3", num_hidden_layers=head.config.num_layers
    )


def head_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    state = head.head_state_dict()
    unexpected = [name for name in state if not name.startswith(HEAD_TENSOR_PREFIXES)]
    if unexpected:
        raise FormatError(f"dflash head has tensors the DFlash formats have no place for: {unexpected}")
    return state


# ---- writers ----------------------------------------------------------------------------------


@register_writer("dflash", ("dflash",), "SGLang (DFLASH), vLLM, z-lab dflash (DFlashDraftModel)")
def write_dflash(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_qwen3_layers(head, "dflash")
    require_engine_features(head, "dflash")
    config = layer_config_dict(head, ARCHITECTURE)
    config["dflash_config"] = {
        "block_size": head.block_size,
        "mask_token_id": head.mask_token_id,
        "target_layer_ids": [index - 1 for index in head.feature_layers],
    }
    config["num_target_layers"] = head.base_spec.num_hidden_layers
    config[DRAFTHEADS_KEY] = head_metadata(head)
    save_tensors(head_tensors(head), directory / WEIGHTS_NAME)
    return write_config(config, directory)


@register_writer("dflash-speculators", ("dflash",), "vLLM (`vllm serve DIR`, speculators dflash)")
def write_dflash_speculators(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_qwen3_layers(head, "dflash-speculators")
    require_engine_features(head, "dflash-speculators")
    verifier = options.verifier or hub_name(head.base_spec.name_or_path)
    depth = proposal_length(options, "DFlash", head.num_draft_steps)  # its block less the known token
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config_dict(head, "Qwen3ForCausalLM"),
        "draft_vocab_size": head.base_spec.vocab_size,  # the whole base vocabulary, no mapping
        "target_hidden_size": head.base_spec.hidden_size,
        "block_size": head.block_size,
        "mask_token_id": head.mask_token_id,
        "aux_hidden_state_layer_ids": list(head.feature_layers),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(head.base_config.architectures or []),
            },
        },
        "torch_dtype": dtype_name(head),
        DRAFTHEADS_KEY: head_metadata(head),
    }
    save_tensors(head_tensors(head), directory / WEIGHTS_NAME)
    return write_config(config, directory)


# ---- readers ----------------------------------------------------------------------------------


@register_reader
class DFlashReader(EngineReader):
    """``DFlashDraftModel`` checkpoints: ours and the DFlash releases."""

    name = "dflash"
    kind = "dflash"
    description = f"dflash ({ARCHITECTURE})"
    geometry_fields = LAYER_GEOMETRY

    def recognises(self, saved):
        return ARCHITECTURE in (saved.get("architectures") or [])

    def dflash_fields(self, config: dict[str, Any], where: Path) -> dict[str, Any]:
        """block_size, mask_token_id and the fused layers as HF hidden_states indices."""
        fields = config.get("dflash_config") or {}
        if not fields.get("target_layer_ids"):
            raise FormatError(f"{where}: dflash_config.target_layer_ids is missing")
        return {
            "block_size": fields.get("block_size", config.get("block_size")),
            "mask_token_id": fields.get("mask_token_id"),
            "feature_layers": [index + 1 for index in fields["target_layer_ids"]],
        }

    def base_config_fields(self, config):
        # The drafter's geometry is the base's; model_type stays unknown (the layers are Qwen3).
        return {name: config[name] for name in self.geometry_fields if name in config}

    def base_num_layers(self, config):
        if config.get("num_target_layers"):
            return int(config["num_target_layers"]), "base num_hidden_layers (num_target_layers)"
        return None

    def head_config_values(self, config, base_num_layers):
        values = {
            key: value for key, value in self.dflash_fields(config, Path("config.json")).items() if value
        }
        return {**values, "num_layers": config["num_hidden_layers"], "layer_architecture": "qwen3"}

    def head_state(self, tensors, config, where):
        out, notes = {}, []
        for name, value in tensors.items():
            stripped = name.removeprefix("model.")
            if stripped.startswith(HEAD_TENSOR_PREFIXES):
                out[stripped] = value
            elif "embed_tokens" in name or "lm_head" in name:
                notes.append(f"ignored {name} (the base model's is used)")
            else:
                raise FormatError(f"{where}: tensor '{name}' has no place in a DFlash head")
        return out, notes


@register_reader
class DFlashSpeculatorsReader(DFlashReader):
    """vLLM speculators checkpoints with ``speculators_model_type: dflash``."""

    name = "dflash-speculators"
    description = "speculators dflash"
    base_name_field = "speculators_config.verifier.name_or_path"

    def recognises(self, saved):
        return saved.get("speculators_model_type") == "dflash"

    def engine_config(self, saved, where):
        """Flatten into the ``dflash`` layout: the layer config plus a ``dflash_config``."""
        if not saved.get("aux_hidden_state_layer_ids"):
            raise FormatError(f"{where}: aux_hidden_state_layer_ids is missing")
        config = dict(saved.get("transformer_layer_config") or {})
        config["dflash_config"] = {
            "block_size": saved.get("block_size"),
            "mask_token_id": saved.get("mask_token_id"),
            "target_layer_ids": [index - 1 for index in saved["aux_hidden_state_layer_ids"]],
        }
        return config
