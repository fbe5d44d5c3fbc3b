"""Decode with a dynamic tree that keeps every proposal (EAGLE-2's expansion, top_k frontier nodes
per depth, nothing pruned) and record, for every verification step, each proposed node's parent,
its cumulative draft probability and the nodes the verifier accepted. EAGLE-3 alone, greedy, fp32
on the packed base, the head drafting in its default dtype, 128 new tokens a prompt.

Run from the repository root:
    .venv/bin/python <this file> HEAD PROMPTS LIMIT TOP_K DEPTH OUT.jsonl
PROMPTS: mt-bench (the bench's first turns, spread over categories) or sharegpt-later (the last
LIMIT prompts of docs/results/corpus/smollm2-sharegpt-later-prompts.jsonl.gz, requests the shipped
head never trained on).
"""

import gzip
import json
import sys
import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.draft import AutoregressiveDrafter
from draftheads.infer.tree import DynamicTree

LATER_PROMPTS = "docs/results/corpus/smollm2-sharegpt-later-prompts.jsonl.gz"


def main(head: str, source: str, limit: int, top_k: int, depth: int, out: str) -> None:
    proposals = top_k + top_k * top_k * (depth - 1)  # everything the expansion proposes
    tree = DynamicTree(f"all-k{top_k}-d{depth}", top_k, depth, proposals + 1)
    generator = SpeculativeGenerator.from_pretrained(
        head, dtype="float32", tree=tree, context=False, adaptive=False
    )
    steps = []

    def record(self, draft, accepted_nodes):
        parents = draft.topology.parents[: draft.tokens.numel()]
        accepted = list(accepted_nodes)
        steps.append({"parents": list(parents), "scores": list(draft.scores), "accepted": accepted})

    AutoregressiveDrafter.record = record
    if source == "mt-bench":
        prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, limit)]
    elif source == "sharegpt-later":
        with gzip.open(LATER_PROMPTS, "rt") as f:
            lines = f.read().splitlines()[-limit:]
        chats = [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines]
        prompts = [generator._prompt_ids(chat)[:384] for chat in chats]
    else:
        raise SystemExit(f"PROMPTS must be mt-bench or sharegpt-later, got {source!r}")
    started = time.perf_counter()
    with open(out, "w") as f:
        for index, prompt in enumerate(prompts):
            steps.clear()
            result = generator.generate(prompt, max_new_tokens=128)
            f.write(json.dumps({"prompt": index, "steps": steps}) + "\n")
            print(
                f"prompt {index}: {result.stats.new_tokens} tokens in {len(steps)} steps, "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    head, source, limit, top_k, depth, out = sys.argv[1:7]
    main(head, source, int(limit), int(top_k), int(depth), out)
