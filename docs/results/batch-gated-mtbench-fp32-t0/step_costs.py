"""Per-step cost of a batch: HF batched ``generate`` against our decode loop (gated, as shipped) and
our loop with drafting switched off (every row verifying its root alone), same prompts, same base.

Usage: python docs/results/batch-gated-mtbench-fp32-t0/step_costs.py BATCH NEW_TOKENS
Per step = (time for NEW_TOKENS - time for 1 token) / steps, so the prefill is left out.
"""

import sys
import time

import torch

import draftheads.infer.generate as generate_module
from draftheads.bench import build_prompts
from draftheads.infer.draft import root_only
from draftheads.infer.generate import SpeculativeGenerator

batch, new_tokens = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(2)
generator = SpeculativeGenerator.from_pretrained("docs/results/heads/eagle3-distilled")
model, tokenizer = generator.model, generator.tokenizer
prompts = [p.input_ids[0] for p in build_prompts("mt-bench", tokenizer, 16)][:batch]
generator.generate(prompts, max_new_tokens=8)  # warm-up: cost curves, step gate

longest = max(p.numel() for p in prompts)
ids = torch.full((batch, longest), tokenizer.pad_token_id)
mask = torch.zeros((batch, longest), dtype=torch.long)
for row, prompt in enumerate(prompts):  # left padding, as batched generate wants
    ids[row, longest - prompt.numel() :], mask[row, longest - prompt.numel() :] = prompt, 1


def hf(tokens: int) -> float:
    started = time.perf_counter()
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )
    return time.perf_counter() - started


def ours(tokens: int):
    started = time.perf_counter()
    result = generator.generate(prompts, max_new_tokens=tokens)
    return time.perf_counter() - started, result


hf(2)
one, many = hf(1), hf(new_tokens)
print(f"HF generate: prefill {one:.2f} s, {(many - one) / (new_tokens - 1) * 1000:.1f} ms per step")
one, _ = ours(1)
many, result = ours(new_tokens)
steps = result.stats.verification_steps
print(f"ours, gated: {(many - one) / steps * 1000:.1f} ms per step; {result.stats.summary()}")
generate_module.propose_rows = lambda drafters, roots, positions, trees: [root_only(r) for r in roots]
many, result = ours(new_tokens)
steps = result.stats.verification_steps
print(f"ours, never drafting: {(many - one) / steps * 1000:.1f} ms per step; {result.stats.summary()}")
