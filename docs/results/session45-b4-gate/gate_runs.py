"""Four rows, twice from one generator's fresh state and twice after it decoded single prompts:
the first 32 MT-bench first turns at most four at once (continuous batching), 128 new tokens,
greedy, fp32 on the packed base, the shipped head with its tuned tree, context drafts, adaptive
(what `bench` runs as eagle3+context/adaptive), after the bench's warm-up (all 80 prompts, 16
tokens, four at once). Prints tokens/s, tau and the step gate's measured rates.

Run from the repository root:
    .venv/bin/python <this file> SINGLE_PROMPTS_FIRST [SINGLE_PROMPTS_FIRST ...]
"""

import sys
import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"


def run(single_first: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
    prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, 80)]
    for prompt in prompts[:single_first]:
        generator.generate(prompt, max_new_tokens=128)
    generator.generate(prompts, max_new_tokens=16, batch_size=4)  # the bench's warm-up
    started = time.perf_counter()
    result = generator.generate(prompts[:32], max_new_tokens=128, batch_size=4)
    seconds = time.perf_counter() - started
    tokens = sum(row.stats.new_tokens for row in result.results)
    forwards = sum(row.stats.forward_passes for row in result.results)
    print(
        f"four rows after {single_first} single prompts: {tokens / seconds:.1f} tokens/s, "
        f"tau {tokens / forwards:.2f}"
    )
    print("  " + generator.step_gate.summary().replace("\n", "\n  "), flush=True)


if __name__ == "__main__":
    for count in sys.argv[1:]:
        run(int(count))
