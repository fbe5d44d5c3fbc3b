"""Batched against per-row drafting, for the drafters whose head forwards a batch did not share
before (DFlash's block, Medusa's heads, MTP's catch-up), in continuous batches: the first 16
MT-bench prompts, at most B rows at once, 128 new tokens, the head's tree at every step (no
adaptive drafting, no context drafts), fp32 on the packed base. "per row" runs each row's head
forward on its own, as the decoder did before batching them; "batched" runs one forward for all
rows. The two alternate, R repeats each, beside HF batched ``generate`` (consecutive batches of
B, as ``draftheads bench`` runs it). The outputs are checked identical to each other (greedy,
fp32).

Run from the repository root:
    .venv/bin/python <this file> HEAD B TREE REPEATS
TREE: a tree name, or ``tuned``: the head's tuned tree. HEAD: a head directory, or
``untrained-medusa``: four Medusa-1 heads of one residual block, each projecting with its own
copy of the base lm_head, as ``init_from_base`` starts them (what drafting costs does not depend
on the weights; what it proposes is not worth verifying); ``untrained-mtp``: three MTP modules, as
``init_from_base`` starts them.
"""

import sys
import time

import torch

from draftheads.bench import HFMethod, build_prompts
from draftheads.heads import MedusaConfig, MtpConfig, build_head
from draftheads.infer import SpeculativeGenerator, batch_draft

UNTRAINED = {
    "untrained-medusa": MedusaConfig(num_heads=4, num_layers=1),
    "untrained-mtp": MtpConfig(num_modules=3),
}


def untrained(name: str) -> str:
    from draftheads.base_model import load_base

    model, _ = load_base("smollm2-135m-instruct", dtype="float32")
    torch.manual_seed(0)
    head = build_head(model, UNTRAINED[name], base_name="smollm2-135m-instruct")
    head.init_from_base(model)
    directory = f"runs/s41/{name}"
    head.save_pretrained(directory)
    return directory


def main(head_dir: str, batch: int, tree: str, repeats: int) -> None:
    if head_dir in UNTRAINED:
        head_dir = untrained(head_dir)
    generator = SpeculativeGenerator.from_pretrained(
        head_dir, dtype="float32", tree=None if tree == "tuned" else tree, context=False, adaptive=False
    )
    prompts = build_prompts("mt-bench", generator.tokenizer, 16)
    ids = [p.input_ids for p in prompts]
    batched = dict(batch_draft.TOGETHER)
    per_row = {kind: (lambda requests: [r.run() for r in requests]) for kind in batched}
    hf = HFMethod("generate", generator.model, generator.tokenizer)
    hf.run(prompts[:2], 8, 0.0, 0)
    generator.generate(ids[:2], max_new_tokens=8, batch_size=batch)
    outputs = {}
    for repeat in range(repeats):
        started = time.perf_counter()
        tokens = sum(s.new_tokens for s in hf.run(prompts, 128, 0.0, 0, batch_size=batch))
        print(
            f"repeat {repeat} generate: {tokens / (time.perf_counter() - started):.1f} tokens/s", flush=True
        )
        for name, together in (("per row", per_row), ("batched", batched)):
            batch_draft.TOGETHER.clear()
            batch_draft.TOGETHER.update(together)
            result = generator.generate(ids, max_new_tokens=128, batch_size=batch)
            stats = result.stats
            outputs.setdefault(name, [r.new_tokens for r in result.results])
            rows = sum(r.stats.verification_steps for r in result.results)
            tau = stats.new_tokens / rows
            print(
                f"repeat {repeat} {name}: {stats.new_tokens / stats.seconds:.1f} tokens/s, "
                f"{stats.seconds:.1f} s, tau {tau:.2f} per row",
                flush=True,
            )
    batch_draft.TOGETHER.update(batched)
    print("outputs identical:", outputs["per row"] == outputs["batched"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
