"""Where a continuous-batching step goes: the first 16 MT-bench prompts, at most B rows at once,
128 new tokens, the head's tree TREE at every step (no adaptive drafting, no context drafts), fp32
on the packed base, alternating twice with HF batched ``generate`` (consecutive batches of B),
then a cProfile of one more speculative run.

Run from the repository root:
    .venv/bin/python <this file> HEAD B TREE
"""

import cProfile
import io
import pstats
import sys
import time

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator


def main(head: str, batch: int, tree: str) -> None:
    generator = SpeculativeGenerator.from_pretrained(
        head, dtype="float32", tree=tree, context=False, adaptive=False
    )
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)
    methods = (HFMethod("generate", generator.model, generator.tokenizer), SpeculativeMethod(tree, generator))
    for method in methods:
        method.run(prompts[:2], 8, 0.0, 0)
    for method in methods + methods:
        started = time.perf_counter()
        tokens = sum(s.new_tokens for s in method.run(prompts, 128, 0.0, 0, batch_size=batch))
        print(
            f"{method.name}: {tokens / (time.perf_counter() - started):.1f} tokens/s, {tokens} tokens",
            flush=True,
        )
    profile = cProfile.Profile()
    profile.enable()
    methods[1].run(prompts, 128, 0.0, 0, batch_size=batch)
    profile.disable()
    report = io.StringIO()
    stats = pstats.Stats(profile, stream=report)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats("draftheads", 30)
    print(report.getvalue())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
