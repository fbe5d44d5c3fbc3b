"""Where a one-row EAGLE-3 step goes (docs/benchmarks.md, "What limits the speedup").

The head alone on TREE (a registered tree, or ``tuned``: the head's tuned tree), over the first N
MT-bench first turns, 128 tokens each, greedy, fp32 on the packed base, after plain ``generate``
over the same prompts (two passes, alternating). Prints, per step, the wall time of the base's
verification forward (``rows_forward``), of drafting (``propose_rows``) and inside it of the
head's catch-up and expansions (``catch_up``, ``draft_step``).

Run from the repository root (HEAD defaults to the shipped EAGLE-3 head):
    .venv/bin/python scripts/step_split.py N TREE [HEAD]
"""

import sys
import time

import draftheads.infer.generate as gen_module
from draftheads.bench import HFMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

DEFAULT_HEAD = "eagle3-smollm2"  # a shipped head, by its short name (draftheads.shipped)
spent: dict[str, float] = {}
calls: dict[str, int] = {}


def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
            calls[name] = calls.get(name, 0) + 1

    return wrapper


def main(count: int, tree: str, head: str = DEFAULT_HEAD) -> None:
    generator = SpeculativeGenerator.from_pretrained(
        head, dtype="float32", context=False, adaptive=False, tree=None if tree == "tuned" else tree
    )
    for name in ("rows_forward", "propose_rows"):
        setattr(gen_module, name, timed(name, getattr(gen_module, name)))
    generator.head.catch_up = timed("catch_up", generator.head.catch_up)
    generator.head.draft_step = timed("draft_step", generator.head.draft_step)
    prompts = build_prompts("mt-bench", generator.tokenizer, count)
    plain = HFMethod("generate", generator.model, generator.tokenizer)
    plain.run([prompts[0]], 8, 0.0, 0)
    generator.generate(prompts[0].input_ids, max_new_tokens=8)
    for _ in range(2):
        started = time.perf_counter()
        tokens = sum(s.new_tokens for prompt in prompts for s in plain.run([prompt], 128, 0.0, 0))
        seconds = time.perf_counter() - started
        print(f"generate: {tokens / seconds:.1f} tokens/s, {1e3 * seconds / tokens:.2f} ms a token")
        spent.clear()
        calls.clear()
        steps = tokens = 0
        started = time.perf_counter()
        for prompt in prompts:
            stats = generator.generate(prompt.input_ids, max_new_tokens=128).stats
            steps += stats.verification_steps
            tokens += stats.new_tokens
        seconds = time.perf_counter() - started
        parts = ", ".join(
            f"{name} {1e3 * value / steps:.2f} ms ({calls[name] / steps:.2f} calls)"
            for name, value in spent.items()
        )
        print(
            f"eagle3 on {tree}: {tokens / seconds:.1f} tokens/s, tau {tokens / steps:.2f}, "
            f"{1e3 * seconds / steps:.2f} ms a step; per step: {parts}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:4])
