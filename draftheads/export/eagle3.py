"""EAGLE-3 engine formats: ``eagle3`` (SGLang / vLLM ``LlamaForCausalLMEagle3``) and vLLM's
``speculators`` layout, written and read back.

- ``eagle3``: SGLang ``LlamaForCausalLMEagle3`` (sglang/srt/models/llama_eagle3.py), which vLLM
  also loads (vllm/model_executor/models/llama_eagle3.py renames ``midlayer.`` -> ``layers.0.``).
- ``speculators``: vLLM's speculators config (vllm/transformers_utils/configs/speculators/
  {base,algos}.py): ``vllm serve DIR`` reads the verifier from it. vLLM registers ``eagle3`` there
  and ``peagle`` (P-EAGLE: EAGLE-3's tensors plus ``mask_hidden``, served as eagle3 with
  ``parallel_drafting``), so EAGLE-1 heads have no speculators layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from draftheads.base_model import hub_name
from draftheads.export.checkpoint import (
    DRAFTHEADS_KEY,
    dtype_name,
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
    require_engine_features,
    require_llama_layer,
)
from draftheads.export.registry import (
    EngineReader,
    ExportOptions,
    FormatError,
    proposal_length,
    register_reader,
    register_writer,
)
from draftheads.heads.base import WEIGHTS_NAME, DraftHead
from draftheads.heads.eagle3 import default_feature_layers

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The speculators package's model classes (speculators/models/{eagle3,peagle}).
SPECULATOR_ARCHITECTURES = {"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator"}
HEAD_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")  # besides the layer
# EAGLE-3.1 (arXiv 2605.09992): one RMSNorm per captured layer before fc, and the final norm's output
# handed to the next draft step. vLLM reads both flags from the draft's config (llama_eagle3.py: a
# ModuleList ``fc_norm`` over the captured states' chunks; ``norm_output`` picks the post-norm state
# as the next step's input) and from a speculators config's top level (speculators/algos.py); the
# speculators package names them alike (speculators/models/eagle3/config.py).
EAGLE31_FIELDS = ("fc_norm", "norm_output")
FC_NORM_NAME = re.compile(r"fc_norm\.\d+\.weight")
# P-EAGLE's learned mask-row features: vLLM loads ``mask_hidden`` (any shape, viewed as (1, F h))
# into the buffer its parallel drafting feeds through ``fc`` for every mask row (llama_eagle3.py
# ``load_weights``; v1/spec_decode/llm_base_proposer.py) and reads the mask rows' token from
# ``mask_token_id`` (algos.py ``update_peagle``: ``pard_token``); the speculators package's
# PEagleDraftModel holds it as (1, 1, F h) (speculators/models/peagle/core.py).
MASK_HIDDEN = "mask_hidden"


# ---- capture layers ---------------------------------------------------------------------------
# vLLM llama.py ``get_eagle3_aux_hidden_state_layers`` and SGLang llama.py
# ``set_eagle3_layers_to_capture`` both default to the inputs of decoder layers (2, L // 2, L - 3),
# which is our ``default_feature_layers``. The two engines count other layers differently: vLLM
# reads top-level ``eagle_aux_hidden_state_layer_ids`` as "input of layer i" (= hs[i];
# gpu_model_runner ``_get_eagle3_aux_layers_from_config``), SGLang reads
# ``eagle_config.eagle_aux_hidden_state_layer_ids`` as "output of layer i" and adds one
# (``set_eagle3_layers_to_capture``: ``val + 1``).


def layer_id_fields(head: DraftHead) -> dict[str, Any]:
    """Capture layers, written only when they differ from the engines' shared default. vLLM prefers
    the top-level field, so writing both keeps each engine on the same layers."""
    layers = tuple(head.feature_layers)
    if layers == default_feature_layers(head.base_spec.num_hidden_layers):
        return {}
    return {
        "eagle_aux_hidden_state_layer_ids": list(layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
    }


def eagle3_layer_config(head: DraftHead, architecture: str) -> dict[str, Any]:
    """The draft layer's config as engines build it, its MLP as wide as the head's (engines read
    ``intermediate_size`` from the drafter's own config, not the base's)."""
    config = draft_layer_config(head, architecture, head.layer_config)
    config["intermediate_size"] = head.intermediate_size
    return config


def capture_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """Capture layers as HF hidden_states indices, from whichever engine field is present."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in nested] if nested else None


def eagle31_fields(head: DraftHead) -> dict[str, bool]:
    """EAGLE-3.1's config flags the head sets; none for an EAGLE-3 head, whose exports stay as before."""
    return {name: True for name in EAGLE31_FIELDS if getattr(head.config, name)}


def refuse_eagle31(head: DraftHead, format_name: str) -> None:
    """A format whose loader builds EAGLE-3's graph only refuses an EAGLE-3.1 head: it would draft
    from weights wired differently, losslessly but with little accepted."""
    used = list(eagle31_fields(head))
    if used:
        raise FormatError(
            f"format '{format_name}': this head uses EAGLE-3.1's {' and '.join(used)}, which its "
            "loader does not build. Use --format eagle3 or speculators (vLLM reads both), or draftheads."
        )


# ---- writers ----------------------------------------------------------------------------------


def eagle3_tensors(head: DraftHead, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The head's tensors in the engines' names, its decoder layer under ``layer_prefix``."""
    if len(head.feature_layers) != 3:
        # vLLM builds fc with 3 * hidden inputs (llama_eagle3.py), SGLang with 3 unless told otherwise.
        raise FormatError(
            "the EAGLE-3 engine formats fuse exactly 3 base layers; "
            f"this head reads {len(head.feature_layers)} "
            f"({list(head.feature_layers)}). Use --format draftheads."
        )
    if head.config.num_layers != 1:
        # vLLM's llama_eagle3.py and SGLang's LlamaForCausalLMEagle3 build one midlayer.
        raise FormatError(
            f"the EAGLE-3 engine formats hold one draft layer; this head has {head.config.num_layers} "
            "(head.num_layers). Use --format draftheads."
        )
    state = head.head_state_dict()
    layer = strip_prefix(state, "midlayer.")
    tensors = {f"{layer_prefix}{k}": v for k, v in layer.items()}
    extra = {name for name in state if FC_NORM_NAME.fullmatch(name)}  # EAGLE-3.1's, if any
    for name in ("fc.weight", "norm.weight", "lm_head.weight", *sorted(extra)):
        tensors[name] = state[name]
    if head.kind == "peagle":
        extra.add(MASK_HIDDEN)
        tensors[MASK_HIDDEN] = state[MASK_HIDDEN][None]  # (1, 1, F h), as speculators' own P-EAGLE saves it
    # d2t: int64 offsets (target = draft + d2t[draft]); t2d: bool mask over the target vocabulary.
    tensors["d2t"] = state["d2t"].to(torch.int64)
    tensors["t2d"] = state["t2d"].to(torch.bool)
    unexpected = set(state) - set(HEAD_TENSORS) - extra - {f"midlayer.{k}" for k in layer}
    if unexpected:
        raise FormatError(
            f"eagle3 head has tensors the EAGLE-3 format has no place for: {sorted(unexpected)}"
        )
    return tensors


@register_writer("eagle3", ("eagle3",), "SGLang, vLLM, SafeAILab EAGLE (LlamaForCausalLMEagle3)")
def write_eagle3(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_llama_layer(head.layer_config, "eagle3")
    require_engine_features(head, "eagle3")
    tensors = eagle3_tensors(head, "midlayer.")
    config = eagle3_layer_config(head, "LlamaForCausalLMEagle3")
    config["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])
    config["vocab_size"] = head.base_spec.vocab_size
    config.update(layer_id_fields(head))
    config.update(eagle31_fields(head))
    config[DRAFTHEADS_KEY] = head_metadata(head)
    save_tensors(tensors, directory / WEIGHTS_NAME)
    return write_config(config, directory)


def algorithm_fields(head: DraftHead, options: ExportOptions) -> tuple[str, int, dict[str, Any]]:
    """The speculators algorithm of ``head``, the draft tokens a step vLLM defaults to, and the
    algorithm's own config fields. A P-EAGLE head drafts exactly its trained depths in one forward
    (vLLM: one real row, then num_speculative_tokens - 1 mask rows), as a DFlash export its block."""
    if head.kind == "peagle":
        depth = proposal_length(options, "P-EAGLE", head.num_draft_steps)
        return "peagle", depth, {"mask_token_id": head.mask_token_id}
    return "eagle3", proposal_length(options, "EAGLE-3"), {}


@register_writer("speculators", ("eagle3", "peagle"), "vLLM (`vllm serve DIR`, speculators eagle3 / peagle)")
def write_speculators(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    require_llama_layer(head.layer_config, "speculators")
    require_engine_features(head, "speculators")
    # speculators' own Eagle3DraftModel names the layer ``layers.0.``; vLLM's loader prefixes
    # "model." and reads it directly (llama_eagle3.py load_weights).
    tensors = eagle3_tensors(head, "layers.0.")
    layer_config = eagle3_layer_config(head, "LlamaForCausalLM")
    layer_config["vocab_size"] = head.base_spec.vocab_size
    verifier = options.verifier or hub_name(head.base_spec.name_or_path)
    algorithm, speculative_tokens, own_fields = algorithm_fields(head, options)
    config = {
        "architectures": [SPECULATOR_ARCHITECTURES[algorithm]],
        "speculators_model_type": algorithm,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
        # vLLM algos.py defaults norm_before_residual to TRUE when absent; EAGLE-3 (and our head)
        # keeps the un-normed fc output as the residual, i.e. False.
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
        **eagle31_fields(head),
        **own_fields,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(head.base_config.architectures or []),
            },
        },
        "torch_dtype": dtype_name(head),
        DRAFTHEADS_KEY: head_metadata(head),
    }
    save_tensors(tensors, directory / WEIGHTS_NAME)
    return write_config(config, directory)


# ---- readers ----------------------------------------------------------------------------------

LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer.")


@register_reader
class Eagle3Reader(EngineReader):
    """``LlamaForCausalLMEagle3`` checkpoints, and SafeAILab EAGLE-3 releases whose config says
    only ``LlamaForCausalLM`` (recognised by ``fc`` reading three hidden states)."""

    name = "eagle3"
    kind = "eagle3"
    description = f"eagle3 ({', '.join(ARCHITECTURES)})"
    # The MLP width is the head's own (``Eagle3Config.intermediate_size``), not the base's.
    geometry_fields = tuple(name for name in LAYER_GEOMETRY if name != "intermediate_size")

    def recognises(self, saved):
        return any(architecture in ARCHITECTURES for architecture in saved.get("architectures") or [])

    def recognises_layout(self, tensors):
        return release_fc_inputs(tensors) == 3

    def base_config_fields(self, config):
        return base_fields_from_layer_config(config)

    def base_num_layers(self, config):
        layers = capture_layer_ids(config)
        if layers is None:
            return None
        num_layers = layers[-1] + 3  # invert the default (2, L // 2, L - 3): the last id is L - 3
        return num_layers, f"base num_hidden_layers (taken as {num_layers} from the capture layers {layers})"

    def head_config_values(self, config, base_num_layers):
        values: dict[str, Any] = {"draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"]}
        if "intermediate_size" in config:
            values["intermediate_size"] = config["intermediate_size"]
        layers = capture_layer_ids(config)
        if layers is not None and tuple(layers) != default_feature_layers(base_num_layers):
            values["feature_layers"] = list(layers)
        for name in EAGLE31_FIELDS:
            if config.get(name):
                values[name] = True
        return values

    def head_state(self, tensors, config, where):
        if config.get("norm_before_residual"):
            raise FormatError(
                f"{where}: norm_before_residual=true (residual taken after hidden_norm) is a different "
                "EAGLE-3 variant than the one draftheads implements"
            )
        out: dict[str, torch.Tensor] = {}
        notes: list[str] = []
        for name, value in tensors.items():
            prefix = next((p for p in LAYER_PREFIXES if name.startswith(p)), None)
            bare = name.removeprefix("model.")
            if prefix is not None:
                out["midlayer." + name[len(prefix) :]] = value
            elif name in HEAD_TENSORS:
                out[name] = value
            elif bare in ("fc.weight", "norm.weight") or (
                config.get("fc_norm") and FC_NORM_NAME.fullmatch(bare)
            ):
                out[bare] = value
            elif "embed_tokens" in name:
                notes.append(f"ignored {name} (the base model's embedding is used)")
            else:
                raise FormatError(f"{where}: tensor '{name}' has no place in an EAGLE-3 head")
        vocab, draft_vocab = config["vocab_size"], out["lm_head.weight"].shape[0]
        if "d2t" not in out:
            if draft_vocab != vocab:
                raise FormatError(f"{where}: draft vocabulary {draft_vocab} < {vocab} but no d2t mapping")
            out["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
        if "t2d" not in out:
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[torch.arange(draft_vocab) + out["d2t"]] = True
            out["t2d"] = t2d
        return out, notes


# speculators model types read elsewhere: dflash by draftheads.export.dflash, peagle below.
OTHER_SPECULATORS = ("dflash", "peagle")


@register_reader
class SpeculatorsReader(Eagle3Reader):
    """vLLM speculators checkpoints (``speculators_model_type``) of EAGLE-3."""

    name = "speculators"
    description = "speculators eagle3"
    base_name_field = "speculators_config.verifier.name_or_path"
    model_type = "eagle3"

    def recognises(self, saved):
        return "speculators_model_type" in saved and saved["speculators_model_type"] not in OTHER_SPECULATORS

    def recognises_layout(self, tensors):
        return False

    def engine_config(self, saved, where):
        """Flatten the speculators config into the plain draft-layer config EAGLE-3 reads."""
        if saved["speculators_model_type"] != self.model_type:
            raise FormatError(
                f"{where}: speculators_model_type '{saved['speculators_model_type']}' is not readable here "
                "(readable: eagle3, peagle, dflash)"
            )
        config = dict(saved.get("transformer_layer_config") or {})
        for key in (
            "draft_vocab_size",
            "eagle_aux_hidden_state_layer_ids",
            "norm_before_residual",
            "target_hidden_size",
            *EAGLE31_FIELDS,
        ):
            if key in saved:
                config[key] = saved[key]
        return config


@register_reader
class PEagleSpeculatorsReader(SpeculatorsReader):
    """vLLM speculators checkpoints of P-EAGLE: EAGLE-3's, plus ``mask_hidden`` and the mask token;
    the draft depth is the proposal's ``speculative_tokens``."""

    name = "speculators-peagle"
    kind = "peagle"
    description = "speculators peagle"
    model_type = "peagle"

    def recognises(self, saved):
        return saved.get("speculators_model_type") == self.model_type

    def engine_config(self, saved, where):
        config = super().engine_config(saved, where)
        config["mask_token_id"] = saved.get("mask_token_id")
        methods = (saved.get("speculators_config") or {}).get("proposal_methods") or [{}]
        config["speculative_tokens"] = methods[0].get("speculative_tokens")
        return config

    def head_config_values(self, config, base_num_layers):
        values = super().head_config_values(config, base_num_layers)
        if config.get("mask_token_id") is not None:
            values["mask_token_id"] = config["mask_token_id"]
        if config.get("speculative_tokens"):
            values["ttt_steps"] = config["speculative_tokens"]
        return values

    def head_state(self, tensors, config, where):
        if MASK_HIDDEN not in tensors:
            raise FormatError(f"{where}: a speculators peagle checkpoint without '{MASK_HIDDEN}'")
        mask_hidden = tensors[MASK_HIDDEN]
        rest = {name: value for name, value in tensors.items() if name != MASK_HIDDEN}
        out, notes = super().head_state(rest, config, where)
        out[MASK_HIDDEN] = mask_hidden.reshape(1, -1)
        return out, notes
