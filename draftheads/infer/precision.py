"""The dtype a head drafts in: bf16 beside an fp32 base, where that pays.

A draft only proposes; the base's verification decides every emitted token, so the drafter's
precision moves acceptance, never the output: greedy output stays the base's own, and sampling
keeps the base's distribution, since verification takes drafts as fixed candidates whose draft
probabilities never enter its acceptance test (docs/inference.md). On a 2-core CPU a drafting
forward reads its weights from memory each time (the shipped EAGLE-3 head has about 10M
parameters, 39 MB in fp32), so bf16 weights halve what it reads; docs/inference.md, "Drafting in
bf16", has the measurements.

``auto`` drafts in bf16 only where all of these hold: the head can (``DraftHead.own_dtype_drafting``,
EAGLE-3, whose drafting reads no base weight but the token embeddings), the base runs in fp32 on the
CPU, linear layers are prepacked (bf16 on the default kernels is slower than packed fp32) and the CPU
has native bf16 dot products (AVX512_BF16 or AMX-BF16). Elsewhere the head drafts in the base's dtype.

``int8`` (asked for, never chosen by ``auto``) keeps the head in the base's dtype and gives its own
linear layers int8 weights (``draftheads.infer.int8``), on the CPU: any head kind can, since its
activations stay in the base's dtype.
"""

from __future__ import annotations

import torch

from draftheads.infer.int8 import int8_supported, quantize_linears
from draftheads.infer.packed import can_pack, pack_linears
from draftheads.machine import native_bf16

INT8 = "int8"  # int8 linear weights, activations in the base's dtype
DRAFT_DTYPES = ("auto", "float32", "bfloat16", INT8)
DEFAULT_DRAFT_DTYPE = "auto"


class DraftDtypeError(ValueError):
    """A draft dtype that is not one of ``DRAFT_DTYPES``, or that the head cannot draft in."""


def draft_dtype(head, model, requested: str = DEFAULT_DRAFT_DTYPE, pack: bool = True) -> torch.dtype:
    """The floating-point dtype ``head`` should draft in beside ``model`` (see the module docstring
    for ``auto``; ``int8``: the base's dtype, the linear weights int8).

    Raises:
        DraftDtypeError: ``requested`` is not one of ``DRAFT_DTYPES``, or asks a head that drafts through
            the base's weights for a dtype other than the base's, or int8 where the int8 kernel does not
            run (off the CPU, or a base dtype it does not take).
    """
    if requested not in DRAFT_DTYPES:
        raise DraftDtypeError(f"draft dtype must be one of {', '.join(DRAFT_DTYPES)}, got {requested!r}")
    base = model.dtype
    if requested == "auto":
        pays = (
            head.own_dtype_drafting
            and base == torch.float32
            and model.device.type == "cpu"
            and pack
            and native_bf16()
            and can_pack(torch.bfloat16)
        )
        return torch.bfloat16 if pays else base
    if requested == INT8:
        if model.device.type != "cpu" or not int8_supported(base):
            raise DraftDtypeError(
                f"draft dtype int8: no int8 linear kernel here for a {str(base).removeprefix('torch.')} "
                f"base on {model.device.type} (int8 drafting runs on the CPU beside an fp32 base)"
            )
        return base
    wanted = getattr(torch, requested)
    if wanted != base and not head.own_dtype_drafting:
        raise DraftDtypeError(
            f"draft dtype {requested}: {head.kind} heads draft through the base model's weights, "
            f"so they draft in its dtype ({str(base).removeprefix('torch.')})"
        )
    return wanted


def set_draft_dtype(head, dtype: torch.dtype, pack: bool = True) -> None:
    """Convert the head's own floating-point parameters to ``dtype`` (its buffers, such as rotary
    frequencies, stay as they are) and, with ``pack``, prepack its linear layers in it."""
    for parameter in head.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    if pack:
        pack_linears(head, dtype=dtype)


def prepare_head(head, model, requested: str = DEFAULT_DRAFT_DTYPE, pack: bool = True) -> str:
    """``set_draft_dtype`` with the dtype ``draft_dtype`` chooses (for ``int8``, the head's linear
    layers then quantized, not packed); returns what the head drafts in: ``int8`` or the dtype's name."""
    dtype = draft_dtype(head, model, requested, pack)
    if requested == INT8:
        set_draft_dtype(head, dtype, pack=False)
        quantize_linears(head)
        return INT8
    set_draft_dtype(head, dtype, pack)
    return str(dtype).removeprefix("torch.")
