"""Training's random numbers as pure functions of where they are used (counter-based draws).

Every random draw of a training batch (``train.loss_token_fraction``'s sample of tokens, EAGLE's
feature noise, DFlash's anchors, COD's chain lengths) is a hash of (the row's seed, what the draw
is for, the token position, the channel), and a row's seed a hash of (``train.seed``, epoch,
dataset row). A row therefore draws the same numbers whatever batch slot, padded length,
micro-batch size or rank it lands in, so 2 ranks, 1 rank accumulating, or another length grouping
sample the same tokens of it. This is the counter-based design of Philox (Salmon et al. 2011,
"Parallel random numbers: as easy as 1, 2, 3"): a bijective mix of a counter, not a stream whose
state depends on what was drawn before. The mix is Wellons' ``lowbias32`` ("Hash function
prospector", 2018); values are the same on every device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

MASK = 0xFFFFFFFF  # values are unsigned 32-bit integers held in int64 tensors
FRACTION_BITS = 24  # a float32 holds 24 bits exactly: uniforms are multiples of 2^-24 in [0, 1)

# What a draw is for: each purpose gets its own numbers from the same row seed.
LOSS_TOKENS = 1
FEATURE_NOISE = 2
ANCHORS = 3
CHAIN_STEPS = 4


def multiply32(values: torch.Tensor, constant: int) -> torch.Tensor:
    """``values * constant mod 2^32`` for int64 ``values`` in [0, 2^32), without int64 overflow
    (the product is formed from the constant's two 16-bit halves)."""
    low = values * (constant & 0xFFFF)
    high = ((values * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK


def mix(values: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of [0, 2^32) with full avalanche; int64 in, int64 out."""
    values = values ^ (values >> 16)
    values = multiply32(values, 0x7FEB352D)
    values = values ^ (values >> 15)
    values = multiply32(values, 0x846CA68B)
    return values ^ (values >> 16)


def row_seeds(seed: int, epoch: int, rows: Iterable[int] | torch.Tensor) -> torch.Tensor:
    """(B,) int64 in [0, 2^32): the seed of each dataset row's draws in ``epoch`` of a run seeded
    ``seed`` (``rows``: the batch's dataset row indices, ``row_index``)."""
    if isinstance(rows, torch.Tensor):
        rows = rows.tolist()
    seeds = [
        int.from_bytes(
            hashlib.blake2b(f"{seed}:{int(epoch)}:{row}".encode(), digest_size=4).digest(), "little"
        )
        for row in rows
    ]
    return torch.tensor(seeds, dtype=torch.long)


def uniform(seeds: torch.Tensor, purpose: int, length: int, channels: int | None = None, device=None):
    """U[0, 1) float32 of shape (B, length) or (B, length, channels): entry (b, t[, c]) is a pure
    function of (``seeds[b]``, ``purpose``, t[, c]), so a row's numbers do not depend on the
    batch's other rows or its padded length.

    Args:
        seeds: (B,) int64 row seeds (``row_seeds``); purpose: one of the constants above.
        length: positions per row (the padded T; position t's value is the same for any T > t).
        channels: a third axis (EAGLE's feature noise: the hidden size), or None.
    """
    device = seeds.device if device is None else device
    keys = mix(mix(seeds.to(device=device, dtype=torch.long) & MASK) ^ purpose)  # (B,)
    positions = torch.arange(length, device=device)
    values = mix(keys[:, None] ^ positions[None, :])  # (B, T)
    if channels is not None:
        values = mix(values[:, :, None] ^ torch.arange(channels, device=device))  # (B, T, C)
    return (values >> (32 - FRACTION_BITS)).float() * 2.0**-FRACTION_BITS
