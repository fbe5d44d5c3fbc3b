"""Engine checkpoint formats: write a head in the layout vLLM / SGLang load, and read those back.

Every key name and config field below was checked against the engine's own loading code (cited
per format; the tests in tests/export assert them). In short:

- ``eagle3``      SGLang ``LlamaForCausalLMEagle3`` (sglang/srt/models/llama_eagle3.py), which vLLM also
                  loads (vllm/model_executor/models/llama_eagle3.py renames ``midlayer.`` -> ``layers.0.``).
- ``speculators`` vLLM's speculators config (vllm/transformers_utils/configs/speculators/{base,algos}.py):
                  ``vllm serve DIR`` reads the verifier from it. vLLM registers only ``eagle3`` there.
- ``eagle``       vLLM ``EagleLlamaForCausalLM`` (vllm/model_executor/models/llama_eagle.py): ``fc`` has
                  NO bias there, so a head whose fc.bias is non-zero is refused (use ``eagle-sglang``).
- ``eagle-sglang`` SGLang ``LlamaForCausalLMEagle`` (sglang/srt/models/llama_eagle.py): ``fc`` with bias.
- ``medusa-vllm`` vLLM ``MedusaModel`` (vllm/model_executor/models/medusa.py,
                  vllm/transformers_utils/configs/medusa.py).
- ``mtp-deepseek`` DeepSeek-V3 MTP layers ``model.layers.{L+k}.*`` (vllm/model_executor/models/deepseek_mtp.py);
                  the engine builds them as DeepseekV2DecoderLayer, so only deepseek_v3 bases qualify.

Our own exports also carry a ``draftheads`` block in config.json (head kind, head config, base model),
which engines ignore and which makes the way back exact; checkpoints published by others are read
from the engine fields alone (``load_foreign_head``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftheads.base_model import hub_name
from draftheads.heads.base import (
    CONFIG_NAME,
    FORMAT_VERSION,
    WEIGHTS_NAME,
    DraftHead,
    HeadMismatchError,
    head_class,
)

DRAFTHEADS_KEY = "draftheads"  # metadata block our engine-format exports add to config.json


class FormatError(ValueError):
    """A head cannot be written in, or a checkpoint read from, an engine format; says why."""


@dataclass(frozen=True)
class ExportOptions:
    """Format-specific choices; each default is defined here once."""

    # speculators: proposal length vLLM defaults ``num_speculative_tokens`` to (base.py reads
    # speculators_config.proposal_methods[0].speculative_tokens).
    speculative_tokens: int = 3
    # speculators / model card: the verifier (base model) name engines resolve; default: the name
    # recorded in the head's config.
    verifier: str | None = None


# ---- small helpers ----------------------------------------------------------------------------


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses tensors sharing storage (a materialised shared lm_head): copy repeats."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    plain: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        value = value.detach().contiguous().cpu()
        if value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        plain[name] = value
    save_file(plain, str(path), metadata={"format": "pt"})


def _write_config(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Write config.json; returns what a reader will see (JSON types: lists, not tuples)."""
    text = json.dumps(config, indent=2) + "\n"
    (directory / CONFIG_NAME).write_text(text)
    return json.loads(text)


def _dtype_name(head: DraftHead) -> str:
    return str(next(head.parameters()).dtype).removeprefix("torch.")


def _metadata(head: DraftHead) -> dict[str, Any]:
    """The ``draftheads`` block: what ``load_head`` needs to rebuild the head exactly."""
    return {
        "format_version": FORMAT_VERSION,
        "head_kind": head.kind,
        "head_config": dataclasses.asdict(head.config),
        "base_model": dataclasses.asdict(head.base_spec),
    }


def _rope_fields(base_config) -> dict[str, Any]:
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


def _draft_layer_config(head: DraftHead, architecture: str) -> dict[str, Any]:
    """The base Llama config with one decoder layer: the geometry engines build the drafter from."""
    config = head.base_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id", "dtype", "torch_dtype"):
        config.pop(key, None)
    config.update(_rope_fields(head.base_config))
    config.update(
        architectures=[architecture],
        model_type=head.base_config.model_type,
        num_hidden_layers=1,
        # SGLang uses embed_tokens as lm_head when this is true (llama_eagle3.py, llama_eagle.py):
        # the draft's own lm_head would be ignored.
        tie_word_embeddings=False,
        torch_dtype=_dtype_name(head),
    )
    return config


def _require_llama(head: DraftHead, format_name: str) -> None:
    # The EAGLE drafters in both engines subclass their Llama decoder layer (llama_eagle*.py).
    if head.base_config.model_type not in ("llama",):
        raise FormatError(
            f"format '{format_name}' builds the drafter as a Llama decoder layer; this head's base "
            f"model_type is '{head.base_config.model_type}' (only 'llama' is accepted by the engines' "
            f"LlamaForCausalLMEagle* loaders)"
        )


def _frozen_weight(head: DraftHead, which: str) -> torch.Tensor:
    """A frozen base tensor (``embed`` / ``lm_head``) some formats must materialise."""
    try:
        module = head.embed_tokens if which == "embed" else head.base_lm_head
    except RuntimeError as err:
        raise FormatError(
            f"this format stores the base model's {which} weights, so the head must be attached to its "
            f"base model (export loads it from 'base_model.name_or_path' or --base)"
        ) from err
    return module.weight


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def eagle3_layer_ids(base_num_layers: int) -> tuple[int, int, int]:
    """The engines' default EAGLE-3 capture layers as HF ``hidden_states`` indices (input of
    decoder layer i == hs[i]): vLLM llama.py ``get_eagle3_aux_hidden_state_layers`` and SGLang
    llama.py ``set_eagle3_layers_to_capture`` both default to (2, L // 2, L - 3)."""
    return (2, base_num_layers // 2, base_num_layers - 3)


# ---- writers ----------------------------------------------------------------------------------


def _eagle3_tensors(head: DraftHead, layer_prefix: str) -> dict[str, torch.Tensor]:
    if len(head.feature_layers) != 3:
        # vLLM builds fc with 3 * hidden inputs (llama_eagle3.py), SGLang with 3 unless told otherwise.
        raise FormatError(
            f"the EAGLE-3 engine formats fuse exactly 3 base layers; this head reads {len(head.feature_layers)} "
            f"({list(head.feature_layers)}). Use --format draftheads."
        )
    state = head.head_state_dict()
    tensors = {f"{layer_prefix}{k}": v for k, v in _strip(state, "midlayer.").items()}
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        tensors[name] = state[name]
    # d2t: int64 offsets (target = draft + d2t[draft]); t2d: bool mask over the target vocabulary.
    tensors["d2t"] = state["d2t"].to(torch.int64)
    tensors["t2d"] = state["t2d"].to(torch.bool)
    unexpected = set(state) - {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} - {
        f"midlayer.{k}" for k in _strip(state, "midlayer.")
    }
    if unexpected:
        raise FormatError(f"eagle3 head has tensors the EAGLE-3 format has no place for: {sorted(unexpected)}")
    return tensors


def _layer_id_fields(head: DraftHead) -> dict[str, Any]:
    """Capture layers, written only when they differ from the engines' shared default.

    The two engines count differently: vLLM reads top-level ``eagle_aux_hidden_state_layer_ids``
    as "input of layer i" (= hs[i]; gpu_model_runner ``_get_eagle3_aux_layers_from_config``),
    SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` as "output of layer i" and adds
    one (``set_eagle3_layers_to_capture``: ``val + 1``). vLLM prefers the top-level field, so
    writing both keeps each engine on the same layers."""
    layers = tuple(head.feature_layers)
    if layers == eagle3_layer_ids(head.base_spec.num_hidden_layers):
        return {}
    return {
        "eagle_aux_hidden_state_layer_ids": list(layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
    }


def write_eagle3(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    _require_llama(head, "eagle3")
    tensors = _eagle3_tensors(head, "midlayer.")
    config = _draft_layer_config(head, "LlamaForCausalLMEagle3")
    config["draft_vocab_size"] = int(tensors["lm_head.weight"].shape[0])
    config["vocab_size"] = head.base_spec.vocab_size
    config.update(_layer_id_fields(head))
    config[DRAFTHEADS_KEY] = _metadata(head)
    _save(tensors, directory / WEIGHTS_NAME)
    return _write_config(config, directory)


def write_speculators(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    _require_llama(head, "speculators")
    # speculators' own Eagle3DraftModel names the layer ``layers.0.``; vLLM's loader prefixes
    # "model." and reads it directly (llama_eagle3.py load_weights).
    tensors = _eagle3_tensors(head, "layers.0.")
    layer_config = _draft_layer_config(head, "LlamaForCausalLM")
    layer_config["vocab_size"] = head.base_spec.vocab_size
    verifier = options.verifier or hub_name(head.base_spec.name_or_path)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]),
        # vLLM algos.py defaults norm_before_residual to TRUE when absent; EAGLE-3 (and our head)
        # keeps the un-normed fc output as the residual, i.e. False.
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": options.speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier,
                "architectures": list(head.base_config.architectures or []),
            },
        },
        "torch_dtype": _dtype_name(head),
        DRAFTHEADS_KEY: _metadata(head),
    }
    _save(tensors, directory / WEIGHTS_NAME)
    return _write_config(config, directory)


def _eagle1_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    state = head.head_state_dict()
    tensors = {f"layers.0.{k}": v for k, v in _strip(state, "layer.").items()}
    # Both engines replace the first layer's input_layernorm by identity and load no weight for it.
    tensors.pop("layers.0.input_layernorm.weight", None)
    tensors["fc.weight"] = state["fc.weight"]
    if "fc.bias" in state:
        tensors["fc.bias"] = state["fc.bias"]
    return tensors


def write_eagle(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    _require_llama(head, "eagle")
    tensors = _eagle1_tensors(head)
    bias = tensors.pop("fc.bias", None)
    if bias is not None and bool(bias.abs().max() > 0):
        raise FormatError(
            "vLLM's EagleLlamaForCausalLM builds fc without a bias (vllm/model_executor/models/llama_eagle.py), "
            f"but this head's fc.bias is non-zero (max |b| = {float(bias.abs().max()):.3g}); dropping it would "
            "change the drafts. Export with --format eagle-sglang (SGLang keeps the bias) or train with a "
            "bias-free fc (head.fc_bias=false)."
        )
    config = _draft_layer_config(head, "EagleLlamaForCausalLM")
    config[DRAFTHEADS_KEY] = _metadata(head)
    _save(tensors, directory / WEIGHTS_NAME)
    return _write_config(config, directory)


def write_eagle_sglang(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    _require_llama(head, "eagle-sglang")
    tensors = _eagle1_tensors(head)
    if "fc.bias" not in tensors:
        # SGLang's fc always has a bias (nn.Linear default); without one in the file it keeps its
        # random initialisation (sglang issue #5773), so write explicit zeros.
        tensors["fc.bias"] = torch.zeros(tensors["fc.weight"].shape[0], dtype=tensors["fc.weight"].dtype)
    config = _draft_layer_config(head, "LlamaForCausalLMEagle")
    config[DRAFTHEADS_KEY] = _metadata(head)
    _save(tensors, directory / WEIGHTS_NAME)
    return _write_config(config, directory)


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
        tensors[f"lm_heads.{index}.weight"] = own if own is not None else _frozen_weight(head, "lm_head")
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
        "torch_dtype": _dtype_name(head),
        DRAFTHEADS_KEY: _metadata(head),
    }
    _save(tensors, directory / WEIGHTS_NAME)
    return _write_config(config, directory)


MTP_BASE_TYPES = ("deepseek_v3",)  # DeepSeekMTP builds DeepseekV2DecoderLayer (deepseek_mtp.py)
MTP_WEIGHTS_NAME = "model-mtp.safetensors"


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
        module = _strip(state, source)
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            tensors[target + name] = module[name]
        for name, value in _strip(module, "layer.").items():
            tensors[target + name] = value
        if "norm.weight" not in module:
            raise FormatError(f"mtp head has no modules.{index}.norm.weight to write as shared_head.norm")
        tensors[target + "shared_head.norm.weight"] = module["norm.weight"]
        tensors[target + "shared_head.head.weight"] = _frozen_weight(head, "lm_head")
    # vLLM loads embed_tokens from the first MTP layer only (deepseek_mtp.py load_weights).
    tensors[f"model.layers.{first}.embed_tokens.weight"] = _frozen_weight(head, "embed")
    config = head.base_config.to_dict()
    config.pop("_name_or_path", None)
    config["num_nextn_predict_layers"] = depth
    config[DRAFTHEADS_KEY] = _metadata(head)
    _save(tensors, directory / MTP_WEIGHTS_NAME)
    return _write_config(config, directory)


def write_draftheads(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    head.save_pretrained(directory)
    return json.loads((directory / CONFIG_NAME).read_text())


@dataclass(frozen=True)
class ExportFormat:
    """One output layout: which head kinds it can express, who loads it, and its writer."""

    name: str
    head_kinds: tuple[str, ...]
    loaded_by: str
    write: Callable[[DraftHead, Path, ExportOptions], dict[str, Any]]


FORMAT_REGISTRY: dict[str, ExportFormat] = {
    f.name: f
    for f in (
        ExportFormat("draftheads", ("medusa", "eagle", "eagle3", "mtp"), "draftheads load_head", write_draftheads),
        ExportFormat("eagle3", ("eagle3",), "SGLang, vLLM, SafeAILab EAGLE (LlamaForCausalLMEagle3)", write_eagle3),
        ExportFormat("speculators", ("eagle3",), "vLLM (`vllm serve DIR`, speculators eagle3)", write_speculators),
        ExportFormat("eagle", ("eagle",), "vLLM (EagleLlamaForCausalLM)", write_eagle),
        ExportFormat("eagle-sglang", ("eagle",), "SGLang (LlamaForCausalLMEagle)", write_eagle_sglang),
        ExportFormat("medusa-vllm", ("medusa",), "vLLM (MedusaModel)", write_medusa_vllm),
        ExportFormat("mtp-deepseek", ("mtp",), "vLLM / SGLang DeepSeek-V3 MTP (deepseek_v3 bases only)", write_mtp_deepseek),
    )
}


def formats_for(kind: str) -> list[str]:
    return [name for name, f in FORMAT_REGISTRY.items() if kind in f.head_kinds]


def export_format(name: str, head_kind: str) -> ExportFormat:
    """Look up a format and check it can express ``head_kind``; errors list what would work."""
    if name not in FORMAT_REGISTRY:
        raise FormatError(f"unknown export format '{name}'; known formats: {', '.join(FORMAT_REGISTRY)}")
    chosen = FORMAT_REGISTRY[name]
    if head_kind not in chosen.head_kinds:
        raise FormatError(
            f"format '{name}' cannot express a {head_kind} head (it holds: {', '.join(chosen.head_kinds)}); "
            f"formats for {head_kind} heads: {', '.join(formats_for(head_kind))}"
        )
    return chosen


def write_head(head: DraftHead, directory: str | Path, format_name: str, options: ExportOptions | None = None):
    """Write ``head`` into ``directory`` in ``format_name``; returns the config dict written."""
    chosen = export_format(format_name, head.kind)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return chosen.write(head, directory, options or ExportOptions())


# ---- readers ----------------------------------------------------------------------------------

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
# Without a base model and without our metadata, nothing in an EAGLE-1 / Medusa config says how
# many layers the base has; the head is built with this count and must be attached to decode.
UNKNOWN_BASE_LAYERS = 0


def read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """All tensors of a checkpoint directory (safetensors preferred; pickles read with
    ``weights_only=True`` and a warning). Returns (tensors, files read)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        files = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"no *.safetensors or {'/'.join(PICKLE_SUFFIXES)} weights in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            tensors.update(load_file(str(path)))
            continue
        warnings.warn(
            f"{path}: reading a pickle checkpoint with torch.load(weights_only=True) (tensors only, no code); "
            "prefer safetensors",
            stacklevel=3,
        )
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise FormatError(f"{path}: expected a flat dict of tensors, got {type(loaded).__name__}")
        tensors.update(loaded)
    return tensors, files


def detect_format(saved: dict[str, Any], tensors: dict[str, torch.Tensor], where: Path) -> str:
    """Which engine format a config.json (+ its tensors) is in."""
    if "speculators_model_type" in saved:
        if saved["speculators_model_type"] != "eagle3":
            raise FormatError(
                f"{where}: speculators_model_type '{saved['speculators_model_type']}' is not readable here "
                "(readable: eagle3)"
            )
        return "speculators"
    architectures = saved.get("architectures") or []
    if any(a in EAGLE3_ARCHITECTURES for a in architectures):
        return "eagle3"
    if saved.get("model_type") == "medusa" or "MedusaModel" in architectures:
        return "medusa-vllm"
    if any(a in EAGLE_ARCHITECTURES for a in architectures):
        return "eagle"
    # SafeAILab's own EAGLE-1 releases say "LlamaForCausalLM" and differ only in their weights.
    if "fc.weight" in tensors and "layers.0.self_attn.q_proj.weight" in tensors:
        ratio = tensors["fc.weight"].shape[1] // tensors["fc.weight"].shape[0]
        return "eagle3" if ratio == 3 else "eagle"
    raise FormatError(
        f"{where}: not a format draftheads reads (config 'format' is not 'draftheads', architectures "
        f"{architectures}); readable: draftheads, eagle3 ({', '.join(EAGLE3_ARCHITECTURES)}), speculators "
        f"eagle3, eagle ({', '.join(EAGLE_ARCHITECTURES)}), medusa-vllm (MedusaModel)"
    )


def _engine_config(saved: dict[str, Any], format_name: str) -> dict[str, Any]:
    """Flatten a speculators config into the plain draft-layer config the other readers use."""
    if format_name != "speculators":
        return dict(saved)
    config = dict(saved.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "target_hidden_size"):
        if key in saved:
            config[key] = saved[key]
    return config


def _to_draftheads_names(format_name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], where: Path):
    """Engine tensor names -> our head's parameter names (the inverse of the writers)."""
    out: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    if format_name in ("eagle3", "speculators"):
        if config.get("norm_before_residual"):
            raise FormatError(
                f"{where}: norm_before_residual=true (residual taken after hidden_norm) is a different "
                "EAGLE-3 variant than the one draftheads implements"
            )
        for name, value in tensors.items():
            for prefix in ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer."):
                if name.startswith(prefix):
                    out["midlayer." + name[len(prefix) :]] = value
                    break
            else:
                if name in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"):
                    out[name] = value
                elif name.removeprefix("model.") in ("fc.weight", "norm.weight"):
                    out[name.removeprefix("model.")] = value
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
    elif format_name == "eagle":
        for name, value in tensors.items():
            for prefix in ("layers.0.", "model.layers.0."):
                if name.startswith(prefix):
                    if not name.endswith("input_layernorm.weight"):
                        out["layer." + name[len(prefix) :]] = value
                    break
            else:
                if name.removeprefix("model.") in ("fc.weight", "fc.bias"):
                    out[name.removeprefix("model.")] = value
                elif "embed_tokens" in name or name.startswith("lm_head"):
                    notes.append(f"ignored {name} (the base model's embedding and lm_head are used)")
                else:
                    raise FormatError(f"{where}: tensor '{name}' has no place in an EAGLE-1 head")
        if "fc.bias" not in out:  # vLLM-layout checkpoints have no fc bias: an exact zero
            out["fc.bias"] = torch.zeros(out["fc.weight"].shape[0], dtype=out["fc.weight"].dtype)
    elif format_name == "medusa-vllm":
        if config.get("truncated_vocab_size", config["vocab_size"]) != config["vocab_size"] or "token_map" in tensors:
            raise FormatError(f"{where}: truncated-vocabulary Medusa heads (token_map) are not supported")
        shared = tensors.get("lm_head.weight") if config.get("original_lm_head") else None
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
    return out, notes


def _check_engine_geometry(config: dict[str, Any], base_config, format_name: str, where: Path) -> None:
    """The engine config must describe the base model: draftheads builds the drafter from it."""
    names = ["hidden_size", "vocab_size"]
    if format_name != "medusa-vllm":
        names += ["num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim", "rms_norm_eps"]
    for name in names:
        actual = getattr(base_config, name, None)
        if name in config and actual is not None and config[name] != actual:
            raise HeadMismatchError(
                f"{where}: {name}={config[name]!r} in the checkpoint, but the base model has {name}={actual!r}"
            )



def _foreign_head_config(kind: str, config: dict[str, Any], base_num_layers: int) -> dict[str, Any]:
    """Head-config values an engine config implies (third-party checkpoints without our metadata)."""
    if kind == "medusa":
        return {"num_heads": config["num_heads"], "num_layers": config["num_hidden_layers"], "shared_lm_head": False}
    if kind == "eagle3":
        values: dict[str, Any] = {"draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"]}
        layers = _foreign_layer_ids(config)
        if layers is not None and tuple(layers) != eagle3_layer_ids(base_num_layers):
            values["feature_layers"] = list(layers)
        return values
    return {}


def _foreign_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """Capture layers as HF hidden_states indices, from whichever engine field is present
    (see ``_layer_id_fields`` for the two conventions)."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return list(config["eagle_aux_hidden_state_layer_ids"])
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in nested] if nested else None


def _reconstructed_base_config(config: dict[str, Any], format_name: str, num_layers: int, model_type: str):
    """A base config rebuilt from the engine fields (no base model given)."""
    from transformers import AutoConfig

    if format_name == "medusa-vllm":
        fields = {"hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"]}
    else:
        skip = {"architectures", "model_type", "draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids",
                "norm_before_residual", "target_hidden_size", DRAFTHEADS_KEY, "torch_dtype", "dtype", "transformers_version"}
        fields = {k: v for k, v in config.items() if k not in skip}
    fields["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(model_type, **fields)


def load_foreign_head(directory: str | Path, saved: dict[str, Any], base_model=None, map_location="cpu") -> DraftHead:
    """Load a head from an engine-format directory (``eagle3``, ``speculators``, ``eagle``,
    ``medusa-vllm``), ours or published by others. With ``base_model`` the checkpoint is checked
    against it (HeadMismatchError names the field) and attached; without one the base config is
    rebuilt from the checkpoint's fields and a warning lists what could not be checked."""
    from draftheads.settings import from_dict

    directory = Path(directory)
    where = directory / CONFIG_NAME
    tensors, files = read_tensors(directory)
    format_name = detect_format(saved, tensors, where)
    config = _engine_config(saved, format_name)
    kind = {"eagle3": "eagle3", "speculators": "eagle3", "eagle": "eagle", "medusa-vllm": "medusa"}[format_name]
    metadata = saved.get(DRAFTHEADS_KEY) or {}
    if metadata and metadata.get("head_kind") != kind:
        raise FormatError(f"{where}: draftheads metadata says head_kind '{metadata.get('head_kind')}', format is {kind}")
    recorded_base = metadata.get("base_model") or {}
    model_type = recorded_base.get("model_type") or config.get("model_type") or "llama"
    if format_name == "medusa-vllm":
        model_type = recorded_base.get("model_type") or "llama"

    unchecked: list[str] = []
    if base_model is not None:
        base_config = base_model.config
        _check_engine_geometry(config, base_config, format_name, where)
        base_name = recorded_base.get("name_or_path") or getattr(base_config, "_name_or_path", "")
    else:
        layers = _foreign_layer_ids(config)
        if "num_hidden_layers" in recorded_base:
            num_layers = recorded_base["num_hidden_layers"]
        elif layers is not None:  # invert the default (2, L // 2, L - 3): the last id is L - 3
            num_layers = layers[-1] + 3
            unchecked.append(f"base num_hidden_layers (taken as {num_layers} from the capture layers {layers})")
        else:
            num_layers = UNKNOWN_BASE_LAYERS
            unchecked.append("base num_hidden_layers (not recorded; pass base_model to decode)")
        base_config = _reconstructed_base_config(config, format_name, num_layers, model_type)
        base_name = recorded_base.get("name_or_path") or (
            (saved.get("speculators_config") or {}).get("verifier", {}).get("name_or_path") or ""
        )
        if not metadata:
            unchecked.append("that the drafter's layer geometry and vocabulary match a base model")
        if format_name == "medusa-vllm" and not metadata:
            unchecked.append("base model_type (assumed llama)")
        if "rms_norm_eps" not in config and format_name != "medusa-vllm":
            unchecked.append("rms_norm_eps (config default used)")

    cls = head_class(kind)
    if metadata:
        head_config = from_dict(cls.config_class, metadata["head_config"], f"{where}:{DRAFTHEADS_KEY}.head_config")
    else:
        values = _foreign_head_config(kind, config, base_config.num_hidden_layers)
        head_config = from_dict(cls.config_class, values, f"{where} (engine fields)")
    head = cls(head_config, base_config, base_name)

    state, notes = _to_draftheads_names(format_name, tensors, config, where)
    if kind == "medusa" and head_config.shared_lm_head:
        # Our export materialised the shared base lm_head per head; the head itself keeps none.
        copies = [state.pop(k) for k in sorted(state) if k.endswith(".lm_head.weight")]
        if base_model is not None:
            base_weight = base_model.get_output_embeddings().weight.detach().cpu()
            if any(not torch.equal(c.to(base_weight.dtype), base_weight) for c in copies):
                raise HeadMismatchError(f"{where}: the lm_heads written for a shared-lm_head Medusa head differ "
                                        "from this base model's lm_head")
    expected = head.state_dict()
    if kind == "eagle" and "fc.bias" not in expected:  # trained with fc_bias: false; the file has none
        state.pop("fc.bias", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise FormatError(
            f"{', '.join(str(f) for f in files)}: does not fit a {kind} head built from {where}: "
            f"missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise HeadMismatchError(
                f"{where}: tensor '{name}' has shape {tuple(value.shape)}, a {kind} head for this base model "
                f"needs {tuple(expected[name].shape)}"
            )
    weight_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    head.to(weight_dtype)
    head.load_state_dict(state, strict=True)
    for note in notes:
        warnings.warn(f"{directory}: {note}", stacklevel=3)
    if unchecked:
        warnings.warn(f"{directory}: loaded without a base model; not checked: {'; '.join(unchecked)}", stacklevel=3)
    head.to(map_location)
    if base_model is not None:
        head.to(dtype=base_model.dtype, device=base_model.device)
        head.attach(base_model)
    return head
