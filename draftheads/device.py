"""Whether a torch device can be used here, checked before a model is loaded onto it.

``torch.device("cuda")`` parses on any build; moving a model there fails only later, deep in
torch, with an AssertionError (a CPU-only build) or a RuntimeError (no driver, no such index).
"""

from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """A device this machine or this torch build cannot use; the message says what to use instead."""


def check_device(name: str | torch.device) -> torch.device:
    """``name`` as a ``torch.device``, or DeviceError naming it when torch cannot use it here:
    CUDA without a visible GPU or with too few, MPS where it is not available."""
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
