"""Every decoding step of the first PROMPTS MT-bench first turns (default 80), at most WIDTH at
once (continuous batching), 128 new tokens, greedy, fp32 on the packed base, the shipped head with
its tuned tree, context drafts, adaptive (what `bench` runs as eagle3+context/adaptive), with the
step gate forced to draft at every step (``draft``) or never (``plain``), after the bench's warm-up.
Writes what the decode loop tells the gate about each step (rows, drafted, tokens it counts, seconds,
tokens emitted and expected, whether the head caught up) to trace-MODE-WIDTH.json.gz and prints
tokens/s.

Run from the repository root:
    .venv/bin/python <this file> draft|plain WIDTH [PROMPTS]
"""

import gzip
import json
import sys
import time
from pathlib import Path

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"


def main(mode: str, width: int, count: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
    generator.step_gate.drafts = lambda batch: mode == "draft"
    prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, 80)]
    generator.generate(prompts, max_new_tokens=16, batch_size=width)  # the bench's warm-up
    steps = []
    record = generator.step_gate.record

    def logged(batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
        step = {"rows": batch, "drafted": drafted, "tokens": tokens, "seconds": seconds}
        steps.append(step | {"emitted": emitted, "expected": expected, "catching_up": catching_up})
        record(batch, drafted, tokens, seconds, emitted=emitted, expected=expected, catching_up=catching_up)

    generator.step_gate.record = logged
    started = time.perf_counter()
    result = generator.generate(prompts[:count], max_new_tokens=128, batch_size=width)
    seconds = time.perf_counter() - started
    tokens = sum(row.stats.new_tokens for row in result.results)
    print(f"{mode}, {width} rows, {count} prompts: {tokens / seconds:.1f} tokens/s, {len(steps)} steps")
    out = Path(__file__).parent / f"trace-{mode}-{width}.json.gz"
    with gzip.open(out, "wt") as file:
        json.dump(steps, file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 80)
