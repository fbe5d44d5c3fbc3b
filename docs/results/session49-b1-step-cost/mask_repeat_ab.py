"""The verification forward (``rows_forward``) on chains of 6 and 12 nodes with the folded attention's
mask repeated in every layer (the decoder before this session: ``mask_repeats_shared`` replaced by a
context that does nothing) and once per forward (as shipped), alternating in one process, packed
fp32 base, cache of 180 entries; 40 rounds, the first 3 dropped, medians.

Run from the repository root:
    .venv/bin/python docs/results/session49-b1-step-cost/mask_repeat_ab.py
"""

import contextlib
import time

import torch
from cached_base import CACHED, cached_base

import draftheads.infer.forward as forward_module
from draftheads.infer.cache import crop_to_lengths
from draftheads.infer.forward import rows_forward
from draftheads.infer.tree import tree_topology


def main() -> None:
    base = cached_base()
    model, layers, ids, cache, slots = base.model, base.layers, base.ids, base.cache, base.slots
    variants = {"every layer": contextlib.nullcontext, "once a forward": forward_module.mask_repeats_shared}
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(40):
            for nodes in (6, 12):
                topology = tree_topology([-1] + list(range(nodes - 1)))
                for name, context in variants.items():
                    forward_module.mask_repeats_shared = context
                    started = time.perf_counter()
                    rows_forward(model, cache, [ids[0, :nodes]], [topology], slots, layers)
                    times.setdefault((nodes, name), []).append(time.perf_counter() - started)
                    crop_to_lengths([cache], [CACHED])
    for (nodes, name), values in times.items():
        values = sorted(values[3:])
        print(f"{nodes} nodes, mask repeated {name}: median {1e3 * values[len(values) // 2]:.2f} ms")


if __name__ == "__main__":
    main()
