"""A draft head's linear layers with int8 weights: a quarter of fp32's bytes read per drafting forward.

On a CPU a drafting forward over one to a few rows reads every weight of the head from memory, so
its cost follows the bytes read more than the arithmetic (the shipped EAGLE-3 head holds about 9M
linear weights: 37 MB in fp32, 18 MB in bf16, 9 MB in int8). ``Int8Linear`` stores each weight
row-wise symmetric in int8, one scale per output channel (absmax / 127, as in LLM.int8()'s
vector-wise quantization, Dettmers et al. 2022), and runs PyTorch's dynamic int8 linear
(``quantized::linear_dynamic``, fbgemm on x86): each call quantizes its fp32 input per tensor to
8 bits, multiplies in int8 with int32 sums (VNNI dot products where the CPU has them) and returns
fp32. Without VNNI the input keeps 7 bits (``reduce_range``) so the AVX2 kernel's 16-bit pair
sums cannot saturate. This kernel measured fastest of the formats ``scripts/draft_kernels.py``
compares; PyTorch's weight-only int8 matmul with fp32 activations was slower than fp32 itself.

Only drafting changes: a draft proposes and the base's verification decides every emitted token,
so int8 weights move acceptance, never the output (the argument of ``draftheads.infer.precision``).
The layer keeps its floating-point ``weight`` parameter (``isinstance``, ``.weight`` and state
dicts unchanged), runs ``F.linear`` while autograd records, and re-quantizes after an in-place
change of its weight.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

INT8_MAX = 127
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of int8 dot products


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> its int8 rows and one fp32 scale per row (absmax / 127; an all-zero
    row gets scale 1 and stays zero)."""
    weight = weight.detach().float()
    scales = weight.abs().amax(dim=1) / INT8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    rows = torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return rows.contiguous(), scales


@functools.cache
def _reduce_range() -> bool:
    """Whether inputs keep 7 bits (no int8 dot-product instructions); read once, not per forward."""
    from draftheads.machine import cpu_flags

    return not set(VNNI_FLAGS) & set(cpu_flags())


def prepack(weight: torch.Tensor, bias: torch.Tensor | None):
    """The weight in int8 (``quantize_rows``), packed for ``quantized::linear_dynamic`` with its bias."""
    rows, scales = quantize_rows(weight)
    zero = torch.zeros(rows.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensor constructors warn of their deprecation
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(rows, scales.double(), zero, 0)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())


def _int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.quantized.linear_dynamic(flat, packed, _reduce_range())
    return out.reshape(*x.shape[:-1], out.shape[-1])


@functools.cache
def int8_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build runs the dynamic int8 linear on the CPU for ``dtype`` inputs (fp32),
    within int8's rounding of a float matmul."""
    if dtype != torch.float32:
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 32, generator=generator)
        x = torch.randn(3, 32, generator=generator)
        out = _int8_linear(x, prepack(weight, None))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    expected = F.linear(x, weight)
    return out.dtype == dtype and bool(torch.allclose(out, expected, atol=0.2, rtol=0.05))


class Int8Linear(nn.Linear):
    """An ``nn.Linear`` that runs inference on an int8 copy of its weight (``quantize_rows``).

    Built from an existing layer (``Int8Linear.wrap``): it shares that layer's ``weight`` and ``bias``
    parameters. Inputs whose dtype the kernel does not take, or off the CPU, run ``F.linear``.
    """

    @classmethod
    def wrap(cls, linear: nn.Linear) -> Int8Linear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer._quantize()
        return layer

    def _quantize(self) -> None:
        # Not a buffer: an opaque packed layout derived from the weight, never saved.
        self._packed = prepack(self.weight, self.bias)
        self._version = self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # training: the int8 kernel has no backward
        if x.device.type != "cpu" or not int8_supported(x.dtype):
            return F.linear(x, self.weight, self.bias)
        if self.weight._version != self._version:  # changed in place since it was quantized
            self._quantize()
        return _int8_linear(x, self._packed)


def quantize_linears(*modules: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` (or prepacked one) inside each module by an ``Int8Linear``
    sharing its parameters; returns how many."""
    from draftheads.infer.packed import PackedLinear

    replaced = 0
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear or type(child) is PackedLinear:
                    setattr(parent, name, Int8Linear.wrap(child))
                    replaced += 1
    return replaced


def has_int8_linears(module: nn.Module) -> bool:
    return any(isinstance(child, Int8Linear) for child in module.modules())
