"""Learning-rate schedule: linear warmup, then cosine decay to ``learning_rate * min_lr_ratio``.

The schedule is a pure function of the optimiser step, so a resumed run (which restores the
scheduler's step counter) follows exactly the curve an uninterrupted run would.
"""

from __future__ import annotations

import math

import torch


def learning_rate_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimiser step ``step`` (0-based).

    Warmup ramps linearly from 1/warmup_steps to 1 over ``warmup_steps`` steps; then a half cosine
    goes from 1 at step ``warmup_steps`` to ``min_lr_ratio`` at step ``total_steps`` (and stays
    there if training runs longer).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


class WarmupCosine:
    """Picklable ``lr_lambda`` (LambdaLR saves callable objects' ``__dict__`` in its state)."""

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        return learning_rate_factor(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over ``optimizer`` following ``learning_rate_factor``; DeepSpeed steps it once
    per optimiser step (at each gradient-accumulation boundary)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, min_lr_ratio))
