"""Where a batch's time goes when the step gate has stepped aside: HF batched ``generate`` and the
adaptive generator (the shipped head, context drafts) on the first B MT-bench prompts, alternating,
twice each, then a cProfile of one more run of each (internal time of the top functions, and the
cumulative time of this package's own functions).

Session 28: session 27's script with the head that ships now; it ran at commit d4167cb (the
cache's free slots, before ``BufferedLayer``) and wrote ``profile_b16.txt``.

Run from the repository root:
    .venv/bin/python docs/results/session28-batch-slots-mtbench-fp32-t0/profile_batch.py [B]
"""

import cProfile
import io
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"


def profiled(method, prompts) -> str:
    profile = cProfile.Profile()
    profile.enable()
    method.run(prompts, 128, 0.0, 0)
    profile.disable()
    report = io.StringIO()
    stats = pstats.Stats(profile, stream=report)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats("draftheads", 40)
    return report.getvalue()


def main(batch: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)[:batch]
    plain = HFMethod("generate", generator.model, generator.tokenizer)
    speculative = SpeculativeMethod("speculative", generator)
    plain.run(prompts[:2], 8, 0.0, 0)  # warm-up
    speculative.run(prompts[:2], 8, 0.0, 0)
    for method in (plain, speculative, plain, speculative):
        started = time.perf_counter()
        tokens = sum(s.new_tokens for s in method.run(prompts, 128, 0.0, 0))
        print(f"{method.name}: {tokens / (time.perf_counter() - started):.1f} tokens/s")
    print(generator.step_gate.summary())
    for method in (plain, speculative):
        print(f"---- {method.name}\n{profiled(method, prompts)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
