"""Op-level CPU time of draftheads' verification forward (``rows_forward``) on a chain of 1 and of 12
nodes, the packed fp32 base with a cache of 180 entries (torch.profiler, 40 forwards each after 5
unprofiled): which ops grow with the nodes.

Run from the repository root:
    .venv/bin/python docs/results/session49-b1-step-cost/forward_ops.py
"""

import torch
from cached_base import CACHED, cached_base
from torch.profiler import ProfilerActivity, profile

from draftheads.infer.cache import crop_to_lengths
from draftheads.infer.forward import rows_forward
from draftheads.infer.tree import tree_topology

FORWARDS = 40


def main() -> None:
    base = cached_base()
    model, layers, ids, cache, slots = base.model, base.layers, base.ids, base.cache, base.slots
    with torch.inference_mode():
        for nodes in (1, 12):
            topology = tree_topology([-1] + list(range(nodes - 1)))

            def forward(nodes=nodes, topology=topology):
                rows_forward(model, cache, [ids[0, :nodes]], [topology], slots, layers)
                crop_to_lengths([cache], [CACHED])

            for _ in range(5):
                forward()
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(FORWARDS):
                    forward()
            print(f"---- {nodes} node(s), {FORWARDS} forwards; times are totals over them")
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
