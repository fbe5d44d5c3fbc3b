"""Where four rows' steps go: the first 16 MT-bench first turns at most four at once, 128 new
tokens, greedy, fp32 on the packed base, the shipped head (tuned tree, context drafts, adaptive
tree sizes) with the step gate forced to draft at every step (``draft``) or never (``plain``);
after one untimed pass, two timed passes, each with the seconds spent in the decode loop's parts.

Run from the repository root:
    .venv/bin/python <this file> draft|plain
"""

import sys
import time
from collections import defaultdict

import draftheads.infer.generate as generate_module
from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"
PARTS = ("prefill_rows", "propose_rows", "rows_forward", "verify_tree", "keep_accepted_rows")


def main(mode: str) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
    generator.step_gate.drafts = lambda batch: mode == "draft"
    prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, 16)]
    seconds, calls = defaultdict(float), defaultdict(int)

    def timed(name, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - started
                calls[name] += 1

        return wrapper

    for name in PARTS:
        setattr(generate_module, name, timed(name, getattr(generate_module, name)))
    generator.generate(prompts, max_new_tokens=128, batch_size=4)
    for _ in range(2):
        seconds.clear()
        calls.clear()
        started = time.perf_counter()
        result = generator.generate(prompts, max_new_tokens=128, batch_size=4)
        total = time.perf_counter() - started
        tokens = sum(row.stats.new_tokens for row in result.results)
        steps = calls["rows_forward"]
        print(
            f"{mode}: {tokens / total:.1f} tokens/s, {total:.1f} s, {steps} steps, "
            f"{tokens / steps:.2f} tokens a step"
        )
        for name in PARTS:
            if calls[name]:
                print(
                    f"  {name}: {seconds[name]:.2f} s, {calls[name]} calls, "
                    f"{1000 * seconds[name] / calls[name]:.2f} ms each"
                )
        print(f"  the rest of the loop: {total - sum(seconds.values()):.2f} s")


if __name__ == "__main__":
    main(sys.argv[1])
