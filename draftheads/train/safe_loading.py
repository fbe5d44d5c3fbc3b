"""Reading training checkpoints without running code from them.

``torch.load(weights_only=False)`` calls whatever a pickle names (``os.system`` included), so a
checkpoint anyone could write to would run their code on resume. Every ``.pt`` file a resume reads
goes through torch's ``weights_only`` unpickler instead (tensors and containers of plain values),
extended by an allow-list of exactly the classes DeepSpeed pickles into its engine state. A file
that needs anything else is refused, naming the file and the global it asked for.

DeepSpeed calls ``torch.load(..., weights_only=False)`` itself (``TorchCheckpointEngine.load``), so
each of its files is first read here with the allow-list (memory-mapped: the pickle is checked, the
tensors are not read), and while DeepSpeed loads, torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes
its calls weights-only too: a file swapped after the check still cannot run code.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from draftheads.heads.base import HeadFormatError

# The classes DeepSpeed 0.19 pickles into a checkpoint besides tensors and plain containers, as
# (module, name): found by listing the globals of the files ZeRO-0/1/2/3 and fp16 runs write.
DEEPSPEED_STATE_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # ZeRO optimizer state 'loss_scaler'
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # ... with fp16's dynamic scale
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeRO optimizer state 'zero_stage'
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2 'param_slice_mappings'
)
# How numpy's RNG state (a uint32 ndarray) pickled in RNG files written before they stored it as a
# tensor, as (module, name, the modules a pickle may name it by: numpy 1 and 2 differ). An ndarray
# rebuilds from bytes, running no code.
LEGACY_RNG_GLOBALS = (
    ("numpy._core.multiarray", "_reconstruct", ("numpy._core.multiarray", "numpy.core.multiarray")),
    ("numpy", "ndarray", ("numpy",)),
    ("numpy", "dtype", ("numpy",)),
    ("numpy.dtypes", "UInt32DType", ("numpy.dtypes",)),
)
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # contradicts the above: unset meanwhile


class UnsafeCheckpointError(HeadFormatError):
    """A checkpoint file whose pickle names a global outside the allow-list: loading it could run
    code, so it is not loaded."""


def deepspeed_state_classes() -> list[Any]:
    """The allow-list for DeepSpeed's engine files (imports DeepSpeed)."""
    return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_STATE_CLASSES]


def legacy_rng_globals() -> list[tuple[Any, str]]:
    """The allow-list for RNG files with a pickled numpy state; empty without numpy (such files
    then cannot exist here)."""
    allowed = []
    for module, name, pickled_modules in LEGACY_RNG_GLOBALS:
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return []
        allowed += [(value, f"{pickled}.{name}") for pickled in pickled_modules]
    return allowed


def _refusal(path: Path, error: pickle.UnpicklingError) -> UnsafeCheckpointError:
    text = str(error)
    named = re.search(r"GLOBAL (\S+)", text)  # torch: "Unsupported global: GLOBAL posix.system was ..."
    details = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\n\n|$)", text, re.DOTALL)
    if named:
        reason = f"it names {named.group(1)}"
    else:
        reason = " ".join((details.group(1) if details else text.splitlines()[0]).split())
    return UnsafeCheckpointError(
        f"{path}: not loaded: its pickle asks for more than tensors and DeepSpeed's own state "
        f"({reason}), and unpickling it could run code; draftheads never writes such a file, so resume "
        "only from checkpoints your own runs wrote"
    )


def load_restricted(path: str | Path, allowed: list, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path)`` with ``weights_only=True`` and the extra classes ``allowed``; a pickle
    asking for anything else raises UnsafeCheckpointError naming the file. ``mmap``: map the
    tensors instead of reading them (zip-format files only; others are read)."""
    path = Path(path)
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise _refusal(path, err) from err


def check_loadable(paths: list[Path], allowed: list) -> None:
    """Refuse (UnsafeCheckpointError naming the file) the first of ``paths`` whose pickle needs
    more than ``allowed``; the tensors themselves are mapped, not read."""
    for path in paths:
        load_restricted(path, allowed, mmap=True)


@contextmanager
def weights_only_loads(allowed: list, where: Path) -> Iterator[None]:
    """Within: every ``torch.load`` is weights-only with the extra classes ``allowed``, whatever
    its caller asked; a pickle asking for more raises UnsafeCheckpointError naming ``where``."""
    saved = {name: os.environ.pop(name, None) for name in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    except pickle.UnpicklingError as err:
        raise _refusal(where, err) from err
    finally:
        os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        os.environ.update({name: value for name, value in saved.items() if value is not None})
