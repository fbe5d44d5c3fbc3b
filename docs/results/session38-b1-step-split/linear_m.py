"""fp32 linear time by rows M: oneDNN prepacked (torch.ops.mkldnn._linear_pointwise, as
draftheads.infer.packed) against plain F.linear (MKL), on SmolLM2's weight shapes."""

import time

import torch
import torch.nn.functional as F

torch.manual_seed(0)
SHAPES = {
    "q/o 576x576": (576, 576),
    "k/v 192x576": (192, 576),
    "gate/up 1536x576": (1536, 576),
    "down 576x1536": (576, 1536),
    "lm_head 49152x576": (49152, 576),
}


def bench(fn, x, reps):
    for _ in range(5):
        fn(x)
    started = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - started) / reps * 1e6


for name, (out_f, in_f) in SHAPES.items():
    w = torch.randn(out_f, in_f)
    from draftheads.infer.packed import PackedLinear

    layer = torch.nn.Linear(in_f, out_f, bias=False)
    layer.weight.data.copy_(w)
    pl = PackedLinear.wrap(layer)
    reps = 50 if out_f > 10000 else 2000
    row = []
    for m in (1, 2, 4, 6, 8, 16):
        x = torch.randn(1, m, in_f)
        with torch.no_grad():
            a = bench(pl, x, reps)
            b = bench(lambda t, w=w: F.linear(t, w), x, reps)
        row.append(f"M={m}: {a:.1f}/{b:.1f}")
    print(f"{name}: packed/plain us  " + "  ".join(row), flush=True)
