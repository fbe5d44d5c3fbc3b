"""A fresh generator on the first N MT-bench prompts in order (what a new process does), R times:
tokens/s over the N prompts and tau per prompt. Run from the repository root; put another checkout
first on PYTHONPATH to time its code. Usage: python first_prompts.py N R"""

import sys
import time

import draftheads
from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"
print("code:", draftheads.__file__)
for run in range(int(sys.argv[2])):
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, int(sys.argv[1]))
    taus, tokens, seconds = [], 0, 0.0
    for p in prompts:
        started = time.perf_counter()
        s = generator.generate(p.input_ids, max_new_tokens=128).stats
        seconds += time.perf_counter() - started
        tokens += s.new_tokens
        taus.append(f"{s.tau:.2f}")
    print(f"run {run}: {tokens / seconds:.1f} tokens/s, tau per prompt {' '.join(taus)}", flush=True)
