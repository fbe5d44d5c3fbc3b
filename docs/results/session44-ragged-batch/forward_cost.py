"""rows_forward on SmolLM2 (fp32, packed), four rows of different prompt lengths (about 90-260
tokens), chains of the given sizes: padded rows against one flat sequence, medians of 12, ms,
twice in turn. Needs the trial applied (git apply ragged-rows.patch).

Run from the repository root: .venv/bin/python <this file>
"""

import time

import torch

from draftheads.infer import SpeculativeGenerator
from draftheads.infer.cache import crop_to_lengths, left_aligned_slots
from draftheads.infer.forward import prefill_rows, rows_forward
from draftheads.infer.tree import tree_topology

torch.set_grad_enabled(False)
generator = SpeculativeGenerator.from_pretrained("runs/s40/heads/cont4", dtype="float32")
model, layers = generator.model, tuple(generator.head.feature_layers)
prompts = [torch.tensor(generator.tokenizer.encode("Hello " * n)) for n in (200, 150, 260, 90)]
cache, _, _ = prefill_rows(model, prompts, layers)
length = cache.get_seq_length()
slots = left_aligned_slots([p.numel() for p in prompts], length)


def median_ms(sizes, ragged, repeats=12):
    topologies = [tree_topology([-1] + list(range(n - 1))) for n in sizes]
    tokens = [torch.randint(0, 40000, (n,)) for n in sizes]
    samples = []
    for index in range(repeats + 2):  # two warm-up calls
        started = time.perf_counter()
        rows_forward(model, cache, tokens, topologies, slots, layers, ragged=ragged)
        if index >= 2:
            samples.append(time.perf_counter() - started)
        crop_to_lengths([cache], [length])
    return 1000 * sorted(samples)[repeats // 2]


for sizes in (
    [1, 1, 1, 1],
    [3, 3, 3, 3],
    [6, 3, 2, 1],
    [4, 4, 4, 4],
    [8, 4, 2, 2],
    [12, 1, 1, 2],
    [5, 5, 5, 5],
):
    runs = [median_ms(sizes, ragged) for ragged in (False, True, False, True)]
    a, b, c, d = runs
    print(sizes, f"padded {a:.1f} ragged {b:.1f} padded {c:.1f} ragged {d:.1f} ms", flush=True)
