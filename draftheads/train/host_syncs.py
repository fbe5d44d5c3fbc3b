"""Counting the calls that make the host wait for the device.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``int(t)``, ``if t:``),
copying it to the host (``.cpu()``, ``.numpy()``) and ops whose output shape depends on values
(``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``, ``repeat_interleave`` with
tensor repeats) block until every queued kernel has run: the GPU then idles while Python catches up,
and CUDA graphs and ``torch.compile`` cannot capture the step. ``HostSyncCounter`` counts those
calls where they are made, on any device (on a CPU nothing waits, but the same calls would), so a
test run on the CPU bounds what a GPU step pays. Calls from ``HOST_CODE`` are left out: that code
reads tensors the host made (the batch before it moves to the device) or, on a CPU, its own host
state (``torch.optim`` reads Adam's step count with ``.item()`` unless it runs fused, as on CUDA).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions that read values on the host or give a value-dependent shape.
SYNCING = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.unique: "unique",
    torch.unique: "unique",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
    torch.argwhere: "nonzero",
    torch.where: "where",  # only its one-argument form (a nonzero); see ``_syncs``
}


# Modules whose calls read host tensors only (see the module docstring).
HOST_CODE = ("draftheads.train.batching", "draftheads.train.draws", "torch.optim")


def _called_from(modules: tuple[str, ...]) -> bool:
    """Whether a frame of the caller's stack runs code of one of ``modules`` (or their submodules)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if any(name == module or name.startswith(module + ".") for module in modules):
            return True
        frame = frame.f_back
    return False


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


def _syncs(func, args, kwargs) -> str | None:
    """The sync kind of one call (None: it does not wait for the device)."""
    if func is torch.Tensor.__getitem__ and len(args) > 1 and _is_bool_index(args[1]):
        return "bool-index"
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "repeat_interleave" if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 else None
    if func is torch.where:
        return "nonzero" if len(args) + len(kwargs) == 1 else None
    return SYNCING.get(func)


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.total`` and ``syncs.kinds`` (a
    Counter by kind). Calls made inside another counted call (a ``tolist`` that itself calls
    ``item``) count once."""

    def __init__(self, host_code: tuple[str, ...] = HOST_CODE):
        super().__init__()
        self.kinds: Counter[str] = Counter()
        self.host_code = host_code
        self._depth = 0

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _syncs(func, args, kwargs) if self._depth == 0 else None
        if kind is not None and _called_from(self.host_code):
            kind = None
        if kind is not None:
            self.kinds[kind] += 1
        self._depth += kind is not None
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= kind is not None
