"""B = 16 on MT-bench, the session-25 setting: HF batched ``generate`` and the adaptive generator
(the shipped head, context drafts), twice each and alternating, then a cProfile of one more
adaptive run (where its time goes: the base's forwards, the prefill, our own loop).

Run from the repository root:
    .venv/bin/python docs/results/session26-b16-repeats-mtbench-fp32-t0/profile_b16.py [B]
"""

import cProfile
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached"


def main(batch: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)[:batch]
    plain = HFMethod("generate", generator.model, generator.tokenizer)
    speculative = SpeculativeMethod("speculative", generator)
    plain.run(prompts[:2], 8, 0.0, 0)  # warm-up
    speculative.run(prompts[:2], 8, 0.0, 0)
    for repeat in range(2):
        rates = []
        for method in (plain, speculative):
            started = time.perf_counter()
            tokens = sum(s.new_tokens for s in method.run(prompts, 128, 0.0, 0))
            rates.append(tokens / (time.perf_counter() - started))
        print(f"repeat {repeat}: generate {rates[0]:.1f} tokens/s, speculative {rates[1]:.1f} "
              f"tokens/s, ratio {rates[1] / rates[0]:.3f}")
    print(generator.step_gate.summary())
    profile = cProfile.Profile()
    profile.enable()
    speculative.run(prompts, 128, 0.0, 0)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
