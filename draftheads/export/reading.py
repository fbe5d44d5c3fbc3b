"""Engine-format checkpoints -> heads: the steps every reader shares.

``load_head`` hands a directory whose config.json is not ours to ``read_engine_head``. The reader
registered for the format (``registry.find_reader``) says what differs between formats; the rest is
the same for all: with a base model the checkpoint is checked against it (``HeadMismatchError``
names the field) and attached; without one the base config is rebuilt from the checkpoint's fields
and a warning lists what could not be checked.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from draftheads.export.checkpoint import DRAFTHEADS_KEY, read_tensors
from draftheads.export.registry import EngineReader, FormatError, find_reader, recognising_readers
from draftheads.heads.base import CONFIG_NAME, DraftHead, HeadMismatchError, head_class

# Without a base model and without our metadata, nothing in an EAGLE-1 / Medusa config says how
# many layers the base has; the head is built with this count and must be attached to decode.
UNKNOWN_BASE_LAYERS = 0
METADATA_BASE_FIELD = f"{DRAFTHEADS_KEY}.base_model.name_or_path"


def _field(saved: dict[str, Any], dotted: str) -> Any:
    value: Any = saved
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def recorded_base_fields(saved: dict[str, Any]) -> tuple[str, ...]:
    """The config.json fields (dotted) that may name an engine checkpoint's base model, in the
    order they are read: our metadata block, then the engine format's own field, if it has one."""
    own = [reader.base_name_field for reader in recognising_readers(saved) if reader.base_name_field]
    return (METADATA_BASE_FIELD, *own)


def recorded_base_name(saved: dict[str, Any]) -> str:
    """The base model an engine checkpoint names (``recorded_base_fields``); "" if none does."""
    for dotted in recorded_base_fields(saved):
        value = _field(saved, dotted)
        if value:
            return str(value)
    return ""


def _check_geometry(config: dict[str, Any], base_config, names: tuple[str, ...], where: Path) -> None:
    """The engine config must describe the base model: draftheads builds the drafter from it."""
    for name in names:
        actual = getattr(base_config, name, None)
        if name in config and actual is not None and config[name] != actual:
            raise HeadMismatchError(
                f"{where}: {name}={config[name]!r} in the checkpoint, "
                f"but the base model has {name}={actual!r}"
            )


def _rebuilt_base_config(
    reader: EngineReader, config: dict[str, Any], recorded_base: dict[str, Any], has_metadata: bool
) -> tuple[Any, list[str]]:
    """A base config rebuilt from the engine fields (no base model given), and what it could not check."""
    from transformers import AutoConfig

    unchecked: list[str] = []
    inferred = reader.base_num_layers(config)
    if "num_hidden_layers" in recorded_base:
        num_layers = recorded_base["num_hidden_layers"]
    elif inferred is not None:
        num_layers, how = inferred
        unchecked.append(how)
    else:
        num_layers = UNKNOWN_BASE_LAYERS
        unchecked.append("base num_hidden_layers (not recorded; pass base_model to decode)")
    if not has_metadata:
        unchecked.append("that the drafter's layer geometry and vocabulary match a base model")
    fields = reader.base_config_fields(config)
    engine_model_type = fields.pop("model_type", None)
    model_type = recorded_base.get("model_type") or engine_model_type
    if not model_type:
        model_type = "llama"
        unchecked.append("base model_type (assumed llama)")
    if "rms_norm_eps" in reader.geometry_fields and "rms_norm_eps" not in config:
        unchecked.append("rms_norm_eps (config default used)")
    fields["num_hidden_layers"] = num_layers
    return AutoConfig.for_model(model_type, **fields), unchecked


def _check_state_fits(
    state: dict[str, torch.Tensor], head: DraftHead, files: list[Path], where: Path
) -> None:
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise FormatError(
            f"{', '.join(str(f) for f in files)}: does not fit a {head.kind} head built from {where}: "
            f"missing {missing[:6]}, unexpected {unexpected[:6]}"
        )
    for name, value in state.items():
        if value.shape != expected[name].shape:
            raise HeadMismatchError(
                f"{where}: tensor '{name}' has shape {tuple(value.shape)}, a {head.kind} head for this base "
                f"model needs {tuple(expected[name].shape)}"
            )


def read_engine_head(
    directory: str | Path, saved: dict[str, Any], base_model=None, map_location: str | torch.device = "cpu"
) -> DraftHead:
    """Load a head from an engine-format directory whose config.json holds ``saved``: any format a
    registered reader recognises (``eagle3``, ``speculators``, ``eagle``, ``medusa-vllm``), ours or
    published by others. ``base_model``, if given, is checked against and attached, never modified."""
    from draftheads.settings import from_dict

    directory = Path(directory)
    where = directory / CONFIG_NAME
    tensors, files = read_tensors(directory)
    reader = find_reader(saved, tensors, where)
    config = reader.engine_config(saved, where)
    metadata = saved.get(DRAFTHEADS_KEY) or {}
    if metadata and metadata.get("head_kind") != reader.kind:
        raise FormatError(
            f"{where}: draftheads metadata says head_kind '{metadata.get('head_kind')}', "
            f"format is {reader.kind}"
        )
    recorded_base = metadata.get("base_model") or {}

    unchecked: list[str] = []
    if base_model is not None:
        base_config = base_model.config
        _check_geometry(config, base_config, reader.geometry_fields, where)
        base_name = recorded_base.get("name_or_path") or getattr(base_config, "_name_or_path", "")
    else:
        base_config, unchecked = _rebuilt_base_config(reader, config, recorded_base, bool(metadata))
        base_name = recorded_base_name(saved)

    cls = head_class(reader.kind)
    if metadata:
        head_config = from_dict(
            cls.config_class, metadata["head_config"], f"{where}:{DRAFTHEADS_KEY}.head_config"
        )
    else:
        values = reader.head_config_values(config, base_config.num_hidden_layers)
        head_config = from_dict(cls.config_class, values, f"{where} (engine fields)")
    # The state is checked against the head built on the meta device, so that a width in the engine
    # config (10**12) is refused from the tensors' shapes, not by an attempt to allocate it.
    with torch.device("meta"):
        skeleton = cls(head_config, base_config, base_name)
    state, notes = reader.head_state(tensors, config, where)
    state = reader.fit_state(state, skeleton, base_model, where)
    _check_state_fits(state, skeleton, files, where)
    head = cls(head_config, base_config, base_name)
    weight_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    head.to(weight_dtype)
    head.load_state_dict(state, strict=True)
    for note in notes:
        warnings.warn(f"{directory}: {note}", stacklevel=3)
    if unchecked:
        warnings.warn(
            f"{directory}: loaded without a base model; not checked: {'; '.join(unchecked)}", stacklevel=3
        )
    head.to(map_location)
    if base_model is not None:
        head.to(dtype=base_model.dtype, device=base_model.device)
        head.attach(base_model)
    return head
