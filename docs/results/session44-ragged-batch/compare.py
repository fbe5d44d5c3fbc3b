"""One node budget for a batch (rows verified as one flat sequence) against one tree size for every
row (rows padded to the largest tree), and HF batched ``generate``: MT-bench prompts, at most B rows
at once (continuous batching), greedy, fp32 on the packed base, the head's tuned tree with context
drafts, adaptive; the three methods interleaved, ``REPEATS`` passes, median tokens/s.

The padded variant is the same generator with ``can_run_ragged`` answering False, which is how the
decode loop ran before ragged rows: rows padded, ``common_tree_size``.

Run from the repository root:
    .venv/bin/python <this file> HEAD PROMPTS REPEATS B [B ...]
"""

import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import draftheads.infer.generate as generate_module
from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.tree import load_tuned_tree
from draftheads.machine import machine_info


@contextmanager
def padded_rows():
    original = generate_module.can_run_ragged
    generate_module.can_run_ragged = lambda model, cache: False
    try:
        yield
    finally:
        generate_module.can_run_ragged = original


def main(head: str, limit: int, repeats: int, batches: list[int]) -> None:
    ragged = SpeculativeGenerator.from_pretrained(head, dtype="float32")
    tree = load_tuned_tree(head, ragged.model.dtype, ragged.model.device)
    padded = SpeculativeGenerator(
        ragged.model, ragged.head, ragged.tokenizer, tree=tree, context=True, adaptive=True, cost=ragged.cost
    )
    padded.batch_costs.update(ragged.batch_costs)
    prompts = build_prompts("mt-bench", ragged.tokenizer, limit)
    methods = {
        "generate": HFMethod("generate", ragged.model, ragged.tokenizer),
        "padded": SpeculativeMethod("padded", padded),
        "ragged": SpeculativeMethod("ragged", ragged),
    }
    for name, method in methods.items():  # warm-up: kernels, allocator
        with padded_rows() if name == "padded" else nullcontext():
            method.run(prompts[:4], 8, 0.0, 0, batch_size=4)
    results = {"machine": machine_info(ragged.model.dtype, "cpu"), "head": head, "prompts": limit, "rows": {}}
    for batch in batches:
        speeds = {name: [] for name in methods}
        taus = {}  # tokens per run: the same for every method (greedy, lossless)
        for _ in range(repeats):
            for name, method in methods.items():
                with padded_rows() if name == "padded" else nullcontext():
                    started = time.perf_counter()
                    stats = method.run(prompts, 128, 0.0, 0, batch_size=batch)
                    seconds = time.perf_counter() - started
                tokens = sum(s.new_tokens for s in stats)
                speeds[name].append(tokens / seconds)
                taus[name] = tokens
                print(
                    f"B={batch} {name}: {tokens / seconds:.1f} tokens/s ({tokens} tokens, {seconds:.1f} s)",
                    flush=True,
                )
        row = {name: statistics.median(v) for name, v in speeds.items()}
        results["rows"][batch] = {"tokens_per_second": speeds, "median": row, "tokens": taus}
        print(
            f"B={batch}: generate {row['generate']:.1f}, padded {row['padded']:.1f} "
            f"({row['padded'] / row['generate']:.2f}x), ragged {row['ragged']:.1f} "
            f"({row['ragged'] / row['generate']:.2f}x)",
            flush=True,
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(b) for b in sys.argv[4:]])
