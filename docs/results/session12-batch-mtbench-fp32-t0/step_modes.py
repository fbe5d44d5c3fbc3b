"""Batched decoding against HF batched ``generate`` on the same prompts and packed base: our loop as
shipped (``gated``), with drafting switched off (``never``: every row verifies its root alone), and
with every step drafting (``always``). Each mode has its own generator (its own step gate); the
methods run interleaved batch by batch, as in ``draftheads bench``.

Usage (from the repository root):
    python docs/results/session12-batch-mtbench-fp32-t0/step_modes.py BATCH NEW_TOKENS PROMPTS MODES
MODES: a comma-separated list of gated, never, always.
"""

import sys

import torch

import draftheads.infer.generate as generate_module
from draftheads.base_model import load_base
from draftheads.bench import HFMethod, build_prompts, speculative_methods
from draftheads.infer.draft import root_only

batch, new_tokens, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
modes = sys.argv[4].split(",")
torch.set_num_threads(2)
model, tokenizer = load_base("smollm2-135m-instruct", dtype="float32", device="cpu")


def speculative(pack: bool):
    (method,) = speculative_methods(
        ["docs/results/heads/eagle3-distilled"],
        model,
        tokenizer,
        None,
        "cpu",
        pack=pack,
        hybrid=True,
        adaptive=True,
        keep=lambda name: name.startswith("eagle3+context/adaptive"),
    )
    return method


methods = {"hf": HFMethod("generate", model, tokenizer)}
for index, mode in enumerate(modes):
    methods[mode] = speculative(pack=index == 0)  # the base is packed once
    if mode == "always":
        methods[mode].generator.step_gate.drafts = lambda rows: True
propose_rows = generate_module.propose_rows


def never(drafters, roots, positions, trees):
    return [root_only(root) for root in roots]


prompts = build_prompts("mt-bench", tokenizer, limit, None)
batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
totals = {mode: [0, 0.0] for mode in methods}
for mode, method in methods.items():  # warm-up, not timed
    generate_module.propose_rows = never if mode == "never" else propose_rows
    method.run(batches[0], 16, 0.0, 0)
for index, prompts_of_batch in enumerate(batches):
    for mode, method in methods.items():
        generate_module.propose_rows = never if mode == "never" else propose_rows
        samples = method.run(prompts_of_batch, new_tokens, 0.0, index)
        totals[mode][0] += sum(s.new_tokens for s in samples)
        totals[mode][1] += sum(s.seconds for s in samples)
reference = totals["hf"][0] / totals["hf"][1]
for mode, (tokens, seconds) in totals.items():
    rate = tokens / seconds
    print(f"{mode}: {tokens} tokens in {seconds:.2f} s = {rate:.1f} tokens/s ({rate / reference:.3f}x)")
for mode, method in methods.items():
    if mode not in ("hf", "never"):
        print(f"{mode} step gate:\n{method.generator.step_gate.summary()}")
