"""What a batch's head catch-ups cost when rows that have just joined (catching up on their prompts)
share one forward with rows catching up on a step's few tokens, padded to the widest, against the
grouping the decoder ships (``catch_up_groups``): the first 32 MT-bench first turns at most four at
once, 128 new tokens, greedy, fp32 on the packed base, the shipped head (tuned tree, context drafts,
adaptive) drafting at every step; the two rules alternate, twice each. Per run: tokens/s, then the
catch-ups whose widest row has more than 16 positions (a row that has just joined) and the others:
count, seconds, ms each; for one forward, also ms per padded position of the wide ones.

Run from the repository root:
    .venv/bin/python <this file>
"""

import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator, batch_draft

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"
ONE_FORWARD = 10**9  # a limit no padding reaches: every row in one forward


def main() -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
    generator.step_gate.drafts = lambda batch: True
    prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, 80)]
    generator.generate(prompts, max_new_tokens=16, batch_size=4)  # the bench's warm-up
    for limit in (ONE_FORWARD, batch_draft.CATCH_UP_PADDING_LIMIT) * 2:
        calls = []

        def timed(requests, limit=limit, calls=calls):
            started = time.perf_counter()
            result = batch_draft.catch_up_together(requests, limit)
            counts = [r.next_ids.shape[1] for r in requests]
            calls.append((counts, time.perf_counter() - started))
            return result

        batch_draft.TOGETHER[batch_draft.CatchUp] = timed
        started = time.perf_counter()
        result = generator.generate(prompts[:32], max_new_tokens=128, batch_size=4)
        seconds = time.perf_counter() - started
        tokens = sum(row.stats.new_tokens for row in result.results)
        name = "one forward" if limit == ONE_FORWARD else f"grouped (limit {limit})"
        print(f"{name}: {tokens / seconds:.1f} tokens/s")
        wide = [(c, s) for c, s in calls if max(c) > 16]
        narrow = [(c, s) for c, s in calls if max(c) <= 16]
        for label, group in (("joining", wide), ("steps", narrow)):
            total = sum(s for _, s in group)
            each = 1000 * total / max(len(group), 1)
            print(f"  {label}: {len(group)} catch-ups, {total:.2f} s, {each:.2f} ms each")
        if limit == ONE_FORWARD and wide:
            padded = sum(len(c) * max(c) for c, _ in wide)
            print(f"  joining: {1e6 * sum(s for _, s in wide) / padded:.1f} us per padded position")


if __name__ == "__main__":
    main()
