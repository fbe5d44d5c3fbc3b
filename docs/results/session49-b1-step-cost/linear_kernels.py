"""SmolLM2-135M's linear layers on M rows with their weights coming from memory, as in a verification
forward: the 30 decoder layers' q, k, v, o, gate, up and down (30 distinct copies of each shape,
cycled) and the 49,152 x 576 lm_head (evicted before each call), through oneDNN's reordered fp32
weights (what ``draftheads.infer.packed`` uses) against MKL's packed sgemm (PyTorch's
``mkl::_mkl_linear``, what inductor used for frozen fp32 linears where MKL is present). Medians
are not needed: each figure averages 15 passes (8 for the lm_head); two rounds.

Run from the repository root:
    .venv/bin/python docs/results/session49-b1-step-cost/linear_kernels.py
"""

import time

import torch

from draftheads.infer.packed import PACK_BATCH_HINT, _packed_linear, _reorder

# name: (out_features, in_features, layers of that shape per decoder layer)
SHAPES = {
    "q": (576, 576, 1),
    "k/v": (192, 576, 2),
    "o": (576, 576, 1),
    "gate/up": (1536, 576, 2),
    "down": (576, 1536, 1),
}
LAYERS = 30


def per_call(function, repeats: int = 15) -> float:
    function()
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    torch.manual_seed(0)
    weights = {name: [torch.randn(o, i) for _ in range(LAYERS)] for name, (o, i, _) in SHAPES.items()}
    onednn = {name: [_reorder(w) for w in ws] for name, ws in weights.items()}
    mkl = {
        name: [torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT) for w in ws]
        for name, ws in weights.items()
    }
    lm_head = torch.randn(49152, 576)
    lm_onednn = _reorder(lm_head)
    lm_mkl = torch.ops.mkl._mkl_reorder_linear_weight(lm_head, PACK_BATCH_HINT)
    evict = [torch.randn(4096, 4096) for _ in range(4)]  # 256 MiB written between lm_head calls

    def cold(function) -> float:
        for tensor in evict:
            tensor.add_(0.0)
        started = time.perf_counter()
        function()
        return time.perf_counter() - started

    def onednn_layers(x, packed):
        return lambda: [_packed_linear(x, p, None) for p in packed]

    def mkl_layers(x, packed, plain):
        pairs = list(zip(packed, plain))
        return lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, PACK_BATCH_HINT) for p, w in pairs]

    def body(kind: str, rows: int) -> float:
        total = 0.0
        for name, (_, in_features, count) in SHAPES.items():
            x = torch.randn(rows, in_features)
            if kind == "oneDNN":
                total += count * per_call(onednn_layers(x, onednn[name]))
            else:
                total += count * per_call(mkl_layers(x, mkl[name], weights[name]))
        return total

    def head(kind: str, rows: int) -> float:
        x = torch.randn(rows, 576)
        if kind == "oneDNN":
            function = onednn_layers(x, [lm_onednn])
        else:
            function = mkl_layers(x, [lm_mkl], [lm_head])
        cold(function)
        return sum(cold(function) for _ in range(8)) / 8

    print("ms per forward's worth: 30 layers' linears (body) and the lm_head, weights from memory")
    for round_ in (1, 2):
        for rows in (1, 6, 12, 16):
            parts = [
                f"{kind} body {1e3 * body(kind, rows):.2f}, lm_head {1e3 * head(kind, rows):.2f}"
                for kind in ("oneDNN", "MKL")
            ]
            print(f"round {round_}, M = {rows:2d}: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
