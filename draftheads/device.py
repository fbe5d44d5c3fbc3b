"""Which torch device a command runs on, and whether it can be used here, checked before a model
is loaded onto it.

``auto`` (every command's default) is this process's GPU where torch sees CUDA: ``cuda:LOCAL_RANK``,
the rank's own under a launcher (``deepspeed``, ``torchrun``), else ``cuda:0``; the CPU elsewhere.

``torch.device("cuda")`` parses on any build; moving a model there fails only later, deep in
torch, with an AssertionError (a CPU-only build) or a RuntimeError (no driver, no such index).
"""

from __future__ import annotations

import os

import torch

AUTO = "auto"
DEFAULT_DEVICE = AUTO  # every command's and every settings dataclass's default


class DeviceError(RuntimeError):
    """A device this machine or this torch build cannot use; the message says what to use instead."""


def auto_device() -> torch.device:
    """The device ``auto`` names here: this process's GPU (its LOCAL_RANK's) or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_device(name: str | torch.device) -> torch.device:
    """``name`` as a ``torch.device`` (``auto``: ``auto_device()``), or DeviceError naming it when
    torch cannot use it here: CUDA without a visible GPU or with too few, MPS where it is not
    available."""
    if name == AUTO:
        name = auto_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"not a torch device: {name!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device '{name}' is not available: this torch ({torch.__version__}) sees no CUDA device; "
                "use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device '{name}' is not available: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device '{name}' is not available: torch cannot use MPS here; use --device cpu")
    return device
