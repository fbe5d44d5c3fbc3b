"""A base model without its decoder layers' weights, for training from a feature cache.

Offline training (``data.features``) reads the base's hidden states from the cache; of the base it
needs only its config, token embeddings, final norm and lm_head (the heads' frozen parts and the
targets). ``load_base_skeleton`` builds the model on the meta device and reads just those tensors
from its safetensors files onto the device: the decoder layers (all but a few hundred MB of an 8B
base) stay on the meta device, so no rank reads or holds them. Their names, shapes and dtypes are
kept, so anything that walks the model's state dict sees the same entries; the one thing that reads
their values, the cache's weight fingerprint (``draftheads.data.feature_identity.base_weights_hash``),
reads its samples of them from the files (``probe_values``), so a skeleton and the whole base
have one fingerprint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from draftheads.base_model import BaseModelError, load_tokenizer, resolve_base_path, resolve_dtype
from draftheads.device import check_device

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a model directory (sharded or not)."""
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / SINGLE_NAME
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as reader:
            return dict.fromkeys(reader.keys(), single)
    raise BaseModelError(f"{directory}: no {INDEX_NAME} or {SINGLE_NAME} to read the base's weights from")


def model_directory(name_or_path: str) -> Path:
    """The local directory of a base's files: itself, or its Hub snapshot (downloaded if need be)."""
    path = Path(resolve_base_path(name_or_path))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(files[name]), "pt") as reader:
        return reader.get_tensor(name)


def probe_values(files: dict[str, Path], name: str, probe: int, dtype: torch.dtype) -> torch.Tensor:
    """The first and last ``probe`` values of tensor ``name`` (flattened) as the loaded model would
    hold them (cast to ``dtype``), read from its file without reading the rest of it."""
    from safetensors import safe_open

    with safe_open(str(files[name]), "pt") as reader:
        view = reader.get_slice(name)
        shape = view.get_shape()
        row = max(1, math.prod(shape[1:]))  # values in one leading row
        rows = -(-probe // row)  # leading rows that hold the first ``probe`` values
        head = view[:rows].reshape(-1)[:probe] if shape else view[:].reshape(-1)
        tail = view[max(0, shape[0] - rows) :].reshape(-1)[-probe:] if shape else head
    return torch.cat([head, tail]).to(dtype)


def decoder_layers(model) -> tuple[str, nn.ModuleList]:
    """(state-dict prefix, module list) of the model's decoder layers."""
    for name, module in model.named_modules():
        if name.endswith(".layers") and isinstance(module, nn.ModuleList):
            return name + ".", module
    raise BaseModelError(f"{type(model).__name__}: no decoder layer list (a '.layers' ModuleList) found")


def materialize(model, files: dict[str, Path], layer_prefix: str, device, dtype) -> None:
    """Read every parameter outside the decoder layers from ``files`` onto ``device``; tied
    weights (an lm_head sharing the embeddings) are tied again afterwards."""
    for name, parameter in list(model.named_parameters(remove_duplicate=False)):
        if name.startswith(layer_prefix) or name not in files:
            continue
        owner_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = read_tensor(files, name).to(device=device, dtype=dtype)
        owner._parameters[attribute] = nn.Parameter(value, requires_grad=False)
    model.tie_weights()
    missing = [
        name
        for name, parameter in model.named_parameters()
        if parameter.is_meta and not name.startswith(layer_prefix)
    ]
    if missing:
        raise BaseModelError(f"the base's files hold no {', '.join(missing)}")


def load_base_skeleton(name_or_path: str, dtype="auto", device="auto"):
    """``(model, tokenizer)`` like ``load_base``, with the decoder layers left on the meta device
    (no weights read or held): for training from a feature cache. The model cannot run a forward;
    its config, embeddings, final norm and lm_head are the real ones, in ``dtype`` on ``device``;
    ``model.name_or_path`` is the directory of its files, as after ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    directory = model_directory(name_or_path)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    files = weight_files(directory)
    layer_prefix, _ = decoder_layers(model)
    materialize(model, files, layer_prefix, device, torch_dtype)
    rotary = getattr(model.base_model, "rotary_emb", None)
    if rotary is not None:  # tables computed anew on the device: buffers are not in the files
        with torch.device(device):
            model.base_model.rotary_emb = type(rotary)(config)
    model.config._name_or_path = str(directory)  # what from_pretrained records: where its files are
    model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(name_or_path)
