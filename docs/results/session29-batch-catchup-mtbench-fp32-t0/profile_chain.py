"""What a drafting step costs in a batch: HF batched ``generate`` against the shipped EAGLE-3 head
drafting a fixed tree at every step (no adaptive drafting, no context drafts, no step gate) on the
first B MT-bench prompts, alternating, twice each, then a cProfile of one more run of each.

Run from the repository root:
    .venv/bin/python <this file> B TREE       (e.g. 4 chain-2)
"""

import cProfile
import io
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"


def main(batch: int, tree: str) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", tree=tree, context=False, adaptive=False)
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)[:batch]
    methods = (HFMethod("generate", generator.model, generator.tokenizer), SpeculativeMethod(tree, generator))
    for method in methods:  # warm-up
        method.run(prompts[:2], 8, 0.0, 0)
    for method in methods + methods:
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
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats("draftheads", 40)
        print(f"---- {method.name}\n{report.getvalue()}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
