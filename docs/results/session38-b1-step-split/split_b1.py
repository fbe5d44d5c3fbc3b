"""Unprofiled split of a B = 1 EAGLE-3 step: wall time in the base's verification forward
(``rows_forward``), in drafting (``propose_rows``), and the rest, over the first N MT-bench prompts."""

import sys
import time

import draftheads.infer.generate as gen_module
from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"
spent = {}


def timed(name, function):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

    return wrapper


def main(count: int) -> None:
    for name in ("rows_forward", "propose_rows", "prefill_rows"):
        if hasattr(gen_module, name):
            setattr(gen_module, name, timed(name, getattr(gen_module, name)))
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=False, adaptive=False)
    prompts = build_prompts("mt-bench", generator.tokenizer, count)
    methods = (
        HFMethod("generate", generator.model, generator.tokenizer),
        SpeculativeMethod("eagle3", generator),
    )
    for method in methods:
        for prompt in prompts[:2]:
            method.run([prompt], 8, 0.0, 0)
    for _ in range(2):
        for method in methods:
            spent.clear()
            started = time.perf_counter()
            stats = [s for prompt in prompts for s in method.run([prompt], 128, 0.0, 0)]
            elapsed = time.perf_counter() - started
            tokens = sum(s.new_tokens for s in stats)
            steps = sum(s.steps or 0 for s in stats)
            parts = ", ".join(f"{k} {1000 * v / max(steps, 1):.2f} ms/step" for k, v in spent.items())
            # as run: divides by tokens, not steps, wherever there were fewer steps than tokens
            per = 1000 * elapsed / max(steps, tokens)
            print(
                f"{method.name}: {tokens / elapsed:.1f} tok/s, {steps} steps, {per:.2f} ms/step; {parts}",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]))
