"""What a drafting forward of the shipped EAGLE-3 head costs in fp32 and in bf16 beside the same fp32
base: every ``catch_up`` and ``draft_step`` call timed while decoding the first 6 MT-bench prompts
(128 tokens, the head alone, its tuned tree), the two generators alternating, twice.

Run from the repository root, with the CPU to itself:
    .venv/bin/python docs/results/session37-draft-dtype-mtbench-fp32-t0/head_calls.py
"""

import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"


def timed(head, totals):
    """Wrap the head's two drafting forwards so each call adds its seconds to ``totals``."""
    for name in ("catch_up", "draft_step"):
        forward = getattr(head, name)

        def wrapper(*args, _forward=forward, **kwargs):
            started = time.perf_counter()
            result = _forward(*args, **kwargs)
            totals["seconds"] += time.perf_counter() - started
            totals["calls"] += 1
            return result

        setattr(head, name, wrapper)


def main() -> None:
    generators, totals = {}, {}
    for dtype in ("float32", "bfloat16"):
        generators[dtype] = SpeculativeGenerator.from_pretrained(
            HEAD, dtype="float32", context=False, adaptive=False, draft_dtype=dtype
        )
        totals[dtype] = {"seconds": 0.0, "calls": 0}
        timed(generators[dtype].head, totals[dtype])
    prompts = build_prompts("mt-bench", generators["float32"].tokenizer, 24)[:6]
    for repeat in range(2):
        for dtype, generator in generators.items():
            generator.generate(prompts[0].input_ids, max_new_tokens=8)  # warm-up
            totals[dtype].update(seconds=0.0, calls=0)
            started, tokens = time.perf_counter(), 0
            for prompt in prompts:
                tokens += generator.generate(prompt.input_ids, max_new_tokens=128).stats.new_tokens
            seconds = time.perf_counter() - started
            calls = totals[dtype]["calls"]
            print(
                f"pass {repeat + 1}, head drafting in {dtype}: {calls} head forwards, "
                f"{totals[dtype]['seconds'] / calls * 1e3:.3f} ms each; {tokens} tokens in {seconds:.2f} s "
                f"({tokens / seconds:.1f} tokens/s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
