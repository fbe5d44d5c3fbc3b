"""How many rows each verification forward holds in continuous batching: the first LIMIT MT-bench
prompts, at most B rows at once, 128 new tokens, the head's tree TREE at every step (no adaptive
drafting, no context drafts), fp32 on the packed base. Once no prompt waits, the batch shrinks as
its rows finish: the tail of a short benchmark.

Run from the repository root:
    .venv/bin/python <this file> HEAD B TREE LIMIT
"""

import collections
import sys
import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer import generate as generate_module


def main(head: str, batch: int, tree: str, limit: int) -> None:
    rows = []
    forward = generate_module.rows_forward

    def counting(model, cache, tokens, *args):
        rows.append(len(tokens))
        return forward(model, cache, tokens, *args)

    generate_module.rows_forward = counting
    generator = SpeculativeGenerator.from_pretrained(
        head, dtype="float32", tree=tree, context=False, adaptive=False
    )
    prompts = build_prompts("mt-bench", generator.tokenizer, limit)
    started = time.perf_counter()
    result = generator.generate([p.input_ids for p in prompts], max_new_tokens=128, batch_size=batch)
    tokens = sum(len(r.new_tokens) for r in result.results)
    print(
        f"{limit} prompts, at most {batch} rows: {time.perf_counter() - started:.1f} s, "
        f"{tokens} tokens, {len(rows)} steps"
    )
    counts = sorted(collections.Counter(rows).items())
    print("rows per step: " + ", ".join(f"{size}: {count}" for size, count in counts))
    full = sum(count for size, count in counts if size == batch)
    print(
        f"steps with fewer than {batch} rows: {len(rows) - full} of {len(rows)} "
        f"({(len(rows) - full) / len(rows):.0%})"
    )
    print(f"tokens per row-step: {tokens / sum(rows):.2f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
