"""Wall-clock timing of work a device runs asynchronously.

A CUDA kernel launch returns before the kernel has run, so a ``time.perf_counter()`` read right
after a call measures the launch, not the work. Reading the clock after ``synchronize`` measures
the work. CPU work is synchronous, so there it is a no-op.
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run every operation queued on it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
