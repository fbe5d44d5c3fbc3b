"""One base forward on the packed fp32 base with a cache of 180 entries: the kind `generate` runs (one
token, no mask), the same asking for the head's hidden states, and draftheads' verification forward
(``rows_forward``: a 4D tree mask, explicit positions, the head's hidden states) on a chain of 1, 6
and 12 nodes. The cache is cropped back after every call; the five alternate, 60 rounds, the first
5 dropped; median and 10th percentile.

Run from the repository root:
    .venv/bin/python docs/results/session49-b1-step-cost/forward_paths.py
"""

import time

import torch
from cached_base import CACHED, cached_base

from draftheads.compat import cache_kwargs
from draftheads.infer.cache import crop_to_lengths
from draftheads.infer.forward import rows_forward
from draftheads.infer.tree import tree_topology


def main() -> None:
    base = cached_base()
    model, layers, ids, cache, slots = base.model, base.layers, base.ids, base.cache, base.slots

    def chain(nodes: int):
        topology = tree_topology([-1] + list(range(nodes - 1)))
        return lambda: rows_forward(model, cache, [ids[0, :nodes]], [topology], slots, layers)

    forwards = {
        "one token, as generate": lambda: model(input_ids=ids[:, :1], **cache_kwargs(cache), use_cache=True),
        "one token, with hidden states": lambda: model(
            input_ids=ids[:, :1], **cache_kwargs(cache), use_cache=True, output_hidden_states=list(layers)
        ),
        "rows_forward, 1 node": chain(1),
        "rows_forward, 6 nodes": chain(6),
        "rows_forward, 12 nodes": chain(12),
    }
    times: dict[str, list[float]] = {name: [] for name in forwards}
    with torch.inference_mode():
        for _ in range(60):
            for name, forward in forwards.items():
                started = time.perf_counter()
                forward()
                times[name].append(time.perf_counter() - started)
                crop_to_lengths([cache], [CACHED])
    for name, values in times.items():
        values = sorted(values[5:])
        median, low = values[len(values) // 2], values[len(values) // 10]
        print(f"{name}: median {1e3 * median:.2f} ms, p10 {1e3 * low:.2f} ms")


if __name__ == "__main__":
    main()
