"""Op-level CPU time of one B = 1 EAGLE-3 decode against plain ``generate`` (torch.profiler),
on the first N MT-bench prompts, 64 new tokens each."""

import sys

from torch.profiler import ProfilerActivity, profile

from draftheads.bench import HFMethod, SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"


def main(count: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=False, adaptive=False)
    prompts = build_prompts("mt-bench", generator.tokenizer, count)
    methods = (
        HFMethod("generate", generator.model, generator.tokenizer),
        SpeculativeMethod("eagle3", generator),
    )
    for method in methods:
        method.run([prompts[0]], 8, 0.0, 0)
    for method in methods:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stats = [s for prompt in prompts for s in method.run([prompt], 64, 0.0, 0)]
        steps = sum(s.steps or 0 for s in stats) or sum(s.new_tokens for s in stats)
        print(f"---- {method.name}: {steps} steps")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(table)


if __name__ == "__main__":
    main(int(sys.argv[1]))
