"""Four rows at several step-gate smoothings: the first 32 MT-bench first turns, at most four at once
(continuous batching), 128 new tokens, greedy, fp32 on the packed base, the shipped head (tuned tree,
context drafts, adaptive), after the bench's warm-up; a fresh generator per run, the smoothings
interleaved, ROUNDS rounds. Prints tokens/s, tau, and the four-row steps the gate measured of each
kind (warm-up included).

Run from the repository root:
    .venv/bin/python <this file> ROUNDS SMOOTHING [SMOOTHING ...]
"""

import sys
import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.step_gate import StepGate

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"
values = [float(v) for v in sys.argv[2:]]
rounds = int(sys.argv[1])
for _ in range(rounds):
    for smoothing in values:
        gen = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
        gen.step_gate = StepGate(smoothing=smoothing)
        prompts = [p.input_ids for p in build_prompts("mt-bench", gen.tokenizer, 80)]
        gen.generate(prompts, max_new_tokens=16, batch_size=4)
        t = time.perf_counter()
        r = gen.generate(prompts[:32], max_new_tokens=128, batch_size=4)
        s = time.perf_counter() - t
        tokens = sum(x.stats.new_tokens for x in r.results)
        fwd = sum(x.stats.forward_passes for x in r.results)
        d = gen.step_gate.measured.get((4, True))
        p = gen.step_gate.measured.get((4, False))
        print(
            f"smoothing {smoothing}: {tokens / s:.1f} tok/s, tau {tokens / fwd:.2f}, "
            f"four-row steps drafting {d.steps if d else 0} plain {p.steps if p else 0}",
            flush=True,
        )
