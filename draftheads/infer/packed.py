"""Prepacked fp32 linear layers for CPU decoding: verifying a few tokens at close to one token's cost.

Why: in fp32 on CPU, ``F.linear`` on a few rows runs MKL's sgemm, which re-packs the weight on every
call, so verifying a handful of tree tokens can cost far more than one token. oneDNN with the
weight reordered once into its blocked layout (what PyTorch's inductor does for frozen CPU linears)
brings a few-token forward close to a one-token one; the measurements, with the machines they were
taken on, are in docs/inference.md. The math is the same linear map; only the summation order
differs, as it already does between MKL's one-row and many-row kernels.

``pack_linears(model, head)`` swaps every ``nn.Linear`` for a ``PackedLinear`` (an ``nn.Linear`` with the
same parameters plus the reordered copy), so ``isinstance`` checks, ``.weight`` and state dicts are
unchanged. It is an inference optimisation: with autograd recording, a ``PackedLinear`` runs plain
``F.linear``; if its weight is changed in place (an adapter merged, a checkpoint loaded) the copy is
re-packed on the next call. oneDNN's reordered fp32 path needs an x86 CPU; ``packing_supported``
says whether this build and machine have it. A bf16 base stays on the default kernels; a head
drafting in bf16 beside an fp32 base (``draftheads.infer.precision``) is packed in bf16
(``pack_linears(head, dtype=torch.bfloat16)``).

Whether packing pays depends on the CPU and on the forward: on one machine oneDNN's packed kernel
wins for one token and for a tree, on another MKL's one-row kernel beats it for one token
(docs/inference.md). So a ``PackedLinear`` runs packed only for the forward forms it was packed
for: ``one-token`` forwards (plain decoding: one new token per sequence) and ``multi-token`` ones
(prefill, tree verification); ``draftheads.infer.kernel_choice`` measures which pay.
``packed_forms(...)`` overrides that within a scope (one process times both layouts on one model).
Either kernel computes the same linear map, so switching per forward keeps decoding lossless.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 16  # rows oneDNN's layout is chosen for (4, 16 and 64 measured alike: docs/inference.md)
ONE_TOKEN, MULTI_TOKEN = "one-token", "multi-token"
FORMS = (ONE_TOKEN, MULTI_TOKEN)  # forward forms a PackedLinear tells apart by its input's tokens
# The forms run packed within a ``packed_forms`` scope, overriding every layer's own (None: no override).
_FORCED_FORMS: ContextVar[frozenset[str] | None] = ContextVar("packed_forms", default=None)


def forward_form(x: torch.Tensor) -> str:
    """``one-token`` for an input (B, 1, H) (or one row (1, H)), ``multi-token`` otherwise."""
    tokens = x.shape[-2] if x.dim() >= 2 else 1
    return ONE_TOKEN if tokens == 1 else MULTI_TOKEN


@contextmanager
def packed_forms(forms: Iterable[str]) -> Iterator[None]:
    """Within this scope every ``PackedLinear`` runs packed for exactly ``forms`` (the others on
    PyTorch's default kernels), whatever it was packed for."""
    token = _FORCED_FORMS.set(frozenset(forms))
    try:
        yield
    finally:
        _FORCED_FORMS.reset(token)


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run reordered ``dtype`` linears through oneDNN, correctly."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 16, generator=generator).to(dtype)
        x = torch.randn(3, 16, generator=generator).to(dtype)
        out = _packed_linear(x, _reorder(weight), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: its own rounding of the sum
    expected = F.linear(x.float(), weight.float())
    return out.dtype == dtype and bool(torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance))


def packing_supported(model: nn.Module, dtype: torch.dtype = torch.float32) -> bool:
    """True where ``pack_linears`` applies: parameters of ``dtype`` on the CPU and a oneDNN build
    that runs reordered linears of that dtype (x86)."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != dtype:
        return False
    return can_pack(dtype)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that runs inference through a oneDNN-reordered copy of its weight.

    Built from an existing layer (``PackedLinear.wrap``): it shares that layer's ``weight`` and
    ``bias`` parameters, so nothing else about the module changes. ``forms``: the forward forms
    (``FORMS``) it runs packed; the others run ``F.linear``.
    """

    forms: frozenset[str] = frozenset(FORMS)

    @classmethod
    def wrap(cls, linear: nn.Linear, forms: Iterable[str] = FORMS) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        packed.forms = frozenset(forms)
        packed._pack()
        return packed

    def runs_packed(self, form: str) -> bool:
        """Whether a forward of ``form`` runs packed here now (a ``packed_forms`` scope decides)."""
        forced = _FORCED_FORMS.get()
        return form in (self.forms if forced is None else forced)

    def _pack(self) -> None:
        # Not a buffer: the reordered tensor is an opaque oneDNN layout, rebuilt from the weight.
        self._packed_weight = _reorder(self.weight)
        self._packed_version = self.weight._version
        self._packed_dtype = self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # training: the packed op has no backward
        if x.dtype != self.weight.dtype or x.device.type != "cpu" or not self.runs_packed(forward_form(x)):
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._packed_version or self.weight.dtype != self._packed_dtype:
            # changed in place, or converted to another dtype, since it was packed
            if not can_pack(self.weight.dtype):
                return F.linear(x, self.weight, self.bias)
            self._pack()
        return _packed_linear(x, self._packed_weight, self.bias)


def pack_linears(
    *modules: nn.Module, dtype: torch.dtype = torch.float32, forms: Iterable[str] = FORMS
) -> int:
    """Replace every ``nn.Linear`` inside each module (a base model, its head) by a ``PackedLinear``
    sharing its parameters, packed for ``forms``; returns how many were replaced (none in a module
    where ``packing_supported(module, dtype)`` is false: fp32 modules by default). Layers packed
    already take ``forms``; no forms at all unpacks (``unpack_linears``)."""
    forms = frozenset(forms)
    if not forms:
        unpack_linears(*modules)
        return 0
    replaced = 0
    for module in modules:
        if not packing_supported(module, dtype):
            continue
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:  # exact type: peft / quantised subclasses keep their forward
                    setattr(parent, name, PackedLinear.wrap(child, forms))
                    replaced += 1
                elif isinstance(child, PackedLinear):
                    child.forms = forms
    return replaced


def set_packed_forms(*modules: nn.Module, forms: Iterable[str]) -> None:
    """Make every ``PackedLinear`` in the modules run packed for ``forms`` (none: the default
    kernels everywhere, the reordered copies kept)."""
    for module in modules:
        for child in module.modules():
            if isinstance(child, PackedLinear):
                child.forms = frozenset(forms)


def unpack_linears(*modules: nn.Module) -> int:
    """Put a plain ``nn.Linear`` (the same parameters) back in place of every ``PackedLinear``,
    freeing the reordered copies; returns how many."""
    restored = 0
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, PackedLinear):
                    linear = nn.Linear.__new__(nn.Linear)
                    nn.Module.__init__(linear)
                    linear.in_features, linear.out_features = child.in_features, child.out_features
                    linear.weight, linear.bias = child.weight, child.bias
                    setattr(parent, name, linear)
                    restored += 1
    return restored


def has_packed_linears(module: nn.Module, form: str = MULTI_TOKEN) -> bool:
    """Whether forwards of ``form`` (tree verification by default) run packed layers in ``module``."""
    return any(isinstance(child, PackedLinear) and child.runs_packed(form) for child in module.modules())


def packed_description(module: nn.Module) -> str:
    """Which kernels ``module``'s linear layers run, by forward form, e.g.
    ``one-token: default, multi-token: packed``."""
    return ", ".join(
        f"{form}: {'packed' if has_packed_linears(module, form) else 'default'}" for form in FORMS
    )
