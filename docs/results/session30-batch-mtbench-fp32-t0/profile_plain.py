"""Plain batched steps: HF batched ``generate`` against draftheads' decode loop where the step gate
never drafts (the shipped EAGLE-3 head with context drafts and adaptive drafting, at a batch size
whose tuned cost curves rule drafting out), on B MT-bench prompts from START, alternating three
times, then a cProfile of one more run of each.

Run from the repository root:
    .venv/bin/python <this file> B START       (e.g. 8 0)
"""

import cProfile
import io
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"


def main(batch: int, start: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)[start : start + batch]
    methods = (
        HFMethod("generate", generator.model, generator.tokenizer),
        SpeculativeMethod("ours", generator),
    )
    for method in methods:  # warm-up
        method.run(prompts[:2], 8, 0.0, 0)
    for method in methods * 3:
        started = time.perf_counter()
        tokens = sum(s.new_tokens for s in method.run(prompts, 128, 0.0, 0))
        print(f"{method.name}: {tokens / (time.perf_counter() - started):.1f} tokens/s", flush=True)
    for method in methods:
        profile = cProfile.Profile()
        profile.enable()
        method.run(prompts, 128, 0.0, 0)
        profile.disable()
        report = io.StringIO()
        stats = pstats.Stats(profile, stream=report)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(45)
        print(f"---- {method.name}\n{report.getvalue()}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
