"""One linear layer of the shipped EAGLE-3 head's shapes, by kernel and dtype: PyTorch's default
``F.linear`` and oneDNN with the weight prepacked (``draftheads.infer.packed``), fp32 and bf16, on 1
and 6 rows. Each timing cycles through 24 copies of the weight (450 MB for the lm_head shape), so the
weights come from memory as they do while decoding, where the base's 540 MB pass between two
drafting forwards; the median of 9 passes.

Run from the repository root, with the CPU to itself:
    .venv/bin/python docs/results/session37-draft-dtype-mtbench-fp32-t0/linear_kernels.py
"""

import time
from functools import partial

import torch
import torch.nn.functional as F

from draftheads.infer.packed import PACK_BATCH_HINT

COPIES = 24
SHAPES = {"lm_head": (576, 8192), "gate/up": (576, 1536), "down": (1536, 576), "q": (1152, 576)}


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def median_ms(calls, passes: int = 9) -> float:
    for call in calls:
        call()
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - started) / len(calls))
    return sorted(times)[passes // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    print("layer, rows: F.linear fp32 / packed fp32 / F.linear bf16 / packed bf16 (ms)")
    for name, (inputs, outputs) in SHAPES.items():
        weights = [torch.randn(outputs, inputs) * 0.02 for _ in range(COPIES)]
        halves = [w.bfloat16() for w in weights]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
        packed_halves = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in halves]
        for rows in (1, 6):
            x = torch.randn(rows, inputs)
            runs = ((F.linear, x, weights), (packed_linear, x, packed), (F.linear, x.bfloat16(), halves))
            runs += ((packed_linear, x.bfloat16(), packed_halves),)
            times = [median_ms([partial(kernel, xs, w) for w in ws]) for kernel, xs, ws in runs]
            print(
                f"{name} {inputs}x{outputs}, {rows} rows: " + " / ".join(f"{t:.3f}" for t in times),
                flush=True,
            )


if __name__ == "__main__":
    main()
