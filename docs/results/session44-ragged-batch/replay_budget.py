"""Offline replay: how many more tokens a step is expected to accept if a batch's node budget went
to the likeliest nodes of any row instead of one tree size for every row.

Decodes the first PROMPTS MT-bench prompts at most B at once (the head's tuned tree with context
drafts, adaptive, fp32 on the packed base), records at every drafting step each row's path
probabilities (calibrated, as adaptive drafting weighs them) and the size ``common_tree_size``
chose, then replays each step both ways against the batch's verify-cost curve: per row the
likeliest size - 1 nodes, against the likeliest B * (size - 1) nodes of all rows, and against the
best budget of all rows' nodes (a flat step of T tokens priced as B rows of T / B).

Run from the repository root:
    .venv/bin/python <this file> HEAD PROMPTS B
"""

import itertools
import sys

import draftheads.infer.generate as generate_module
from draftheads.bench import SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator


def main(head: str, limit: int, batch: int) -> None:
    steps = []
    choose = generate_module.common_tree_size

    def recording(probabilities, relative_cost, pad_to_multiple=1):
        size = choose(probabilities, relative_cost, pad_to_multiple)
        steps.append(([sorted(map(float, p), reverse=True) for p in probabilities], size, relative_cost))
        return size

    generate_module.common_tree_size = recording
    generator = SpeculativeGenerator.from_pretrained(head, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, limit)
    method = SpeculativeMethod("replay", generator)
    method.run(prompts[:2], 8, 0.0, 0)
    steps.clear()
    method.run(prompts, 128, 0.0, 0, batch_size=batch)
    common = same_total = best = common_cost = best_cost = 0.0
    for rows, size, relative in steps:
        count = len(rows)
        common += count + sum(sum(row[: size - 1]) for row in rows)
        common_cost += relative(size)
        pooled = sorted((p for row in rows for p in row), reverse=True)
        same_total += count + sum(pooled[: count * (size - 1)])
        prefix_sums = itertools.accumulate(pooled, initial=0.0)  # k = 0, 1, ...: the k likeliest
        choices = [(count + total, relative(1 + k / count)) for k, total in enumerate(prefix_sums)]
        tokens, cost = max(choices, key=lambda choice: choice[0] / choice[1])
        best += tokens
        best_cost += cost
    print(f"{len(steps)} drafting steps of up to {batch} rows")
    print(f"one size per row: {common:.0f} expected tokens, {common / common_cost:.2f} per unit of cost")
    print(
        f"the same tokens, the likeliest of any row: {same_total:.0f} "
        f"(+{100 * (same_total / common - 1):.1f}%)"
    )
    print(
        f"best budget per step: {best:.0f} expected tokens, {best / best_cost:.2f} per unit of cost "
        f"(+{100 * ((best / best_cost) / (common / common_cost) - 1):.1f}%)"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
