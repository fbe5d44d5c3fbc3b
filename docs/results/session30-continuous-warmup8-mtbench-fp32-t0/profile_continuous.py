"""Continuous batching at B rows on the 16 MT-bench prompts of the bench: HF ``generate`` in
consecutive batches of B against ``generate(prompts, batch_size=B)`` with the shipped EAGLE-3 head
(context drafts, adaptive drafting), one generator throughout (a warm-up on 4 prompts, then two
timed runs of each, alternating), then a cProfile of one more run of ours.

Run from the repository root: .venv/bin/python <this file> B
"""

import cProfile
import io
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"


def main(batch: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)
    methods = (
        HFMethod("generate", generator.model, generator.tokenizer),
        SpeculativeMethod("ours", generator),
    )
    for method in methods:  # warm-up
        method.run(prompts[:4], 8, 0.0, 0, batch)
    for method in methods * 2:
        started = time.perf_counter()
        tokens = sum(s.new_tokens for s in method.run(prompts, 128, 0.0, 0, batch))
        print(method.name, f"{tokens / (time.perf_counter() - started):.1f} tok/s", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    result = generator.generate([p.input_ids for p in prompts], max_new_tokens=128, batch_size=batch)
    profile.disable()
    print(result.stats.summary())
    report = io.StringIO()
    stats = pstats.Stats(profile, stream=report)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats("draftheads", 45)
    print(report.getvalue())


if __name__ == "__main__":
    main(int(sys.argv[1]))
