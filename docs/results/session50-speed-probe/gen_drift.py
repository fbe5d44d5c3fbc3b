"""Does plain generate slow down over a long bench, and why? Per prompt: generate's ms a token and
the minor page faults it took, first over the first 8 MT-bench turns alone, then over all 80
alternating with EAGLE-3 on its tuned tree (as the bench does), then the first 8 again.

Run from the repository root:
    .venv/bin/python docs/results/session50-speed-probe/gen_drift.py 80
"""

import resource
import sys
import time

from draftheads.bench import HFMethod, build_prompts
from draftheads.infer import SpeculativeGenerator

HEAD = "docs/results/heads/eagle3-corpus-both"


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_generate(plain, prompt):
    f0, t0 = faults(), time.perf_counter()
    (sample,) = plain.run([prompt], 128, 0.0, 0)
    seconds = time.perf_counter() - t0
    return 1e3 * seconds / sample.new_tokens, faults() - f0, sample.new_tokens


def main(count: int) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=False, adaptive=False)
    prompts = build_prompts("mt-bench", generator.tokenizer, count)
    plain = HFMethod("generate", generator.model, generator.tokenizer)
    plain.run([prompts[0]], 8, 0.0, 0)
    generator.generate(prompts[0].input_ids, max_new_tokens=8)

    def first8(label):
        rows = [timed_generate(plain, p) for p in prompts[:8]]
        ms = sum(r[0] for r in rows) / len(rows)
        per_token = sum(r[1] for r in rows) / sum(r[2] for r in rows)
        each = " ".join(f"{r[0]:.1f}" for r in rows)
        print(f"{label}: generate {ms:.2f} ms/token, faults/token {per_token:.0f}", each, flush=True)

    first8("first 8 alone, before")
    for i, prompt in enumerate(prompts):
        ms, nf, n = timed_generate(plain, prompt)
        f0, t0 = faults(), time.perf_counter()
        stats = generator.generate(prompt.input_ids, max_new_tokens=128).stats
        es = time.perf_counter() - t0
        steps = stats.verification_steps
        head = f"{i:2d} id {prompt.id} len {prompt.input_ids.shape[1]:3d}"
        plain_part = f"generate {ms:5.2f} ms/tok faults/tok {nf / n:5.0f}"
        eagle_part = f"eagle3 {1e3 * es / steps:5.2f} ms/step faults/step {(faults() - f0) / steps:5.0f}"
        print(f"{head}: {plain_part} | {eagle_part}", flush=True)
    first8("first 8 alone, after")


if __name__ == "__main__":
    main(int(sys.argv[1]))
