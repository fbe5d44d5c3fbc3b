"""What one drafting forward's linear layers cost per weight format (docs/inference.md, "Drafting in int8").

Times every linear layer of a head (the shipped EAGLE-3 head by default) on 1, 4 and 16 rows, in
each format a CPU drafting forward can run: fp32 on PyTorch's default kernels, fp32 and bf16
prepacked for oneDNN (``draftheads.infer.packed``), int8 weights with fp32 or bf16 activations
(PyTorch's weight-only int8 matmul) and int8 weights with dynamically quantized int8 activations
(``quantized::linear_dynamic``, what ``draft_dtype="int8"`` runs: ``draftheads.infer.int8``), once
packed by each x86 quantized engine: fbgemm (VNNI dot products where the CPU has them) and oneDNN
(AMX-INT8 tiles where it has them). Formats are interleaved round by round
and each figure is the fastest round's, so a slow spell falls on all of them. Prints the CPU's
vector flags and a table of milliseconds per forward (every linear layer of the head once).

Run from the repository root (HEAD defaults to the shipped EAGLE-3 head):
    .venv/bin/python scripts/draft_kernels.py [HEAD]
"""

import sys
import time
import warnings

import torch
import torch.nn.functional as F

from draftheads.heads import load_head
from draftheads.heads.base import resolve_head_dir
from draftheads.infer.int8 import quantize_rows
from draftheads.infer.packed import PackedLinear
from draftheads.machine import cpu_flags

DEFAULT_HEAD = "eagle3-smollm2"
ROWS = (1, 4, 16)
ROUNDS = 7
CALLS = 20  # forwards per timing
ENGINES = ("fbgemm", "onednn")  # x86 quantized engines, each timed where this torch build has it


def linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight.clone()
    return linear


def dynamic_prepack(weight: torch.Tensor, scales: torch.Tensor, engine: str):
    """``weight`` per-channel int8, packed by the quantized engine ``engine`` (the packed object keeps
    its engine: ``linear_dynamic`` runs that engine's kernel whatever the global setting)."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        with warnings.catch_warnings():  # quantized tensors are deprecated; this is a comparison only
            warnings.simplefilter("ignore")
            zero = torch.zeros(weight.shape[0], dtype=torch.long)
            qweight = torch.quantize_per_channel(weight, scales.double(), zero, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


def formats(weight: torch.Tensor) -> dict:
    """Format name -> (a function of the fp32 input, the input dtype it takes)."""
    rows, scales = quantize_rows(weight)
    packed32 = PackedLinear.wrap(linear_of(weight))
    packed16 = PackedLinear.wrap(linear_of(weight.to(torch.bfloat16)))
    supported = torch.backends.quantized.supported_engines
    dynamic = {engine: dynamic_prepack(weight, scales, engine) for engine in ENGINES if engine in supported}
    scales16 = scales.to(torch.bfloat16)
    int8_mm = torch.ops.aten._weight_int8pack_mm
    return {
        "fp32 default": (lambda x: F.linear(x, weight), torch.float32),
        "fp32 packed": (packed32, torch.float32),
        "bf16 packed": (packed16, torch.bfloat16),
        "int8 weights, fp32": (lambda x: int8_mm(x, rows, scales), torch.float32),
        "int8 weights, bf16": (lambda x: int8_mm(x, rows, scales16), torch.bfloat16),
        **{
            f"int8 w8a8 dynamic, {engine}": (
                lambda x, packed=packed: torch.ops.quantized.linear_dynamic(x, packed, False),
                torch.float32,
            )
            for engine, packed in dynamic.items()
        },
    }


def seconds(function, x: torch.Tensor) -> float:
    started = time.perf_counter()
    for _ in range(CALLS):
        function(x)
    return (time.perf_counter() - started) / CALLS


def main(head_dir: str = DEFAULT_HEAD) -> None:
    head = load_head(resolve_head_dir(head_dir))
    weights = [m.weight.detach().float() for m in head.modules() if isinstance(m, torch.nn.Linear)]
    layers = [formats(weight) for weight in weights]
    names = list(layers[0])
    print(f"cpu flags: {' '.join(cpu_flags())}; threads {torch.get_num_threads()}; torch {torch.__version__}")
    print(f"{len(weights)} linear layers, {sum(w.numel() for w in weights) / 1e6:.1f}M weights")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    with torch.no_grad():
        for rows in ROWS:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            best = {name: float("inf") for name in names}
            for _ in range(ROUNDS):
                for name in names:
                    total = 0.0
                    for weight, layer in zip(weights, layers):
                        function, dtype = layer[name]
                        total += seconds(function, inputs[weight.shape[1]].to(dtype))
                    best[name] = min(best[name], total)
            print(f"| {rows} | " + " | ".join(f"{best[name] * 1e3:.3f}" for name in names) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])
