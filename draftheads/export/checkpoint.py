"""Engine-checkpoint files, shared by every writer and reader: safetensors in and out, config.json,
and the ``draftheads`` metadata block our exports add.

The metadata block (head kind, head config, base model) sits in config.json next to the engine's
own fields; engines ignore it, and it makes the way back exact. Checkpoints published by others
lack it and are read from the engine fields alone.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from draftheads.export.registry import FormatError
from draftheads.heads.base import (
    CONFIG_NAME,
    FORMAT_VERSION,
    WEIGHT_SUFFIXES,
    DraftHead,
    inside_head,
    read_weights,
)
from draftheads.storage import apply_default_mode

DRAFTHEADS_KEY = "draftheads"  # metadata block our engine-format exports add to config.json
PICKLE_SUFFIXES = tuple(suffix for suffix in WEIGHT_SUFFIXES if suffix != ".safetensors")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write safetensors; safetensors refuses tensors sharing storage (a materialised shared
    lm_head), so repeats are copied."""
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
    apply_default_mode(path)  # save_file leaves its temporary file's 0600


def write_config(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Write config.json; returns what a reader will see (JSON types: lists, not tuples)."""
    text = json.dumps(config, indent=2) + "\n"
    (directory / CONFIG_NAME).write_text(text)
    return json.loads(text)


def dtype_name(head: DraftHead) -> str:
    return str(next(head.parameters()).dtype).removeprefix("torch.")


def head_metadata(head: DraftHead) -> dict[str, Any]:
    """The ``draftheads`` block: what ``load_head`` needs to rebuild the head exactly."""
    return {
        "format_version": FORMAT_VERSION,
        "head_kind": head.kind,
        "head_config": dataclasses.asdict(head.config),
        "base_model": dataclasses.asdict(head.base_spec),
    }


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix``, with it removed from their names."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def frozen_weight(head: DraftHead, which: str) -> torch.Tensor:
    """A frozen base tensor (``embed`` / ``lm_head``) some formats must materialise."""
    try:
        module = head.embed_tokens if which == "embed" else head.base_lm_head
    except RuntimeError as err:
        raise FormatError(
            f"this format stores the base model's {which} weights, so the head must be attached to its "
            f"base model (export loads it from 'base_model.name_or_path' or --base)"
        ) from err
    return module.weight


def read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """All tensors of a checkpoint directory (safetensors preferred; pickles read with
    ``weights_only=True`` and a warning). Returns (tensors, files read)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        files = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"no *.safetensors or {'/'.join(PICKLE_SUFFIXES)} weights in {directory}")
    files = [inside_head(directory, path) for path in files]  # never a link out of the head
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            tensors.update(read_weights(path))
            continue
        warnings.warn(
            f"{path}: reading a pickle checkpoint with torch.load(weights_only=True) "
            "(tensors only, no code); prefer safetensors",
            stacklevel=4,
        )
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as err:  # torch's errors name no file
            raise FormatError(f"{path}: not a readable torch checkpoint ({err})") from err
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise FormatError(f"{path}: expected a flat dict of tensors, got {type(loaded).__name__}")
        tensors.update(loaded)
    return tensors, files
