"""Losses over a vocabulary projection, a chunk of rows at a time.

A draft step's loss projects its M scored rows onto a vocabulary (N = 32,000 draft ids for
EAGLE-3 on Llama 3, V = 128,256 for Medusa and MTP), upcasts the logits to fp32 and takes a
softmax; autograd keeps the fp32 logits, the log-softmax and the gathered targets, each M x N x 4
bytes: about 1 GiB a step at 8,192 rows and 32,000 ids, over 7 steps of training-time test 20 GiB
or more. Here rows go through ``score`` in chunks of about ``CHUNK_LOGITS`` logits, and with
gradients on each chunk is recomputed in the backward pass (``torch.utils.checkpoint``), so a step
keeps its (M, h) inputs and one chunk's logits at a time (the trade Liger Kernel's fused linear
cross-entropy makes, linkedin/Liger-Kernel). A loss that is a function of per-row sums (a masked mean,
or EAGLE-3's ``PositionTerms``) comes out the same up to the order of the fp32 additions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

# Logits per chunk: 2^25 (128 MiB in fp32; a chunk's softmax and gradient take a few times that).
CHUNK_LOGITS = 2**25


def rows_per_chunk(width: int) -> int:
    """Rows of a ``width``-wide projection that make one chunk."""
    return max(1, CHUNK_LOGITS // max(1, width))


def chunked_sums(
    score: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], width: int
) -> tuple[torch.Tensor, ...]:
    """``score(*chunk)`` summed over chunks of ``inputs``' rows (each sliced along dim 0 alike).

    ``score`` returns a tuple of tensors of fixed shapes (sums over its rows, counts); ``width`` is
    the projection's output size, which sets the chunk. No rows still runs ``score`` once on the
    empty inputs, so the result keeps its gradient path (every rank calls backward).
    """
    rows = inputs[0].shape[0]
    size = rows_per_chunk(width)
    recompute = torch.is_grad_enabled()
    totals = None
    for start in range(0, max(rows, 1), size):
        chunk = [tensor[start : start + size] for tensor in inputs]
        out = checkpoint(score, *chunk, use_reentrant=False) if recompute else score(*chunk)
        totals = out if totals is None else tuple(a + b for a, b in zip(totals, out, strict=True))
    return totals
