"""Where batched decoding's time goes: for our loop as shipped (``gated``) and with drafting switched
off (``never``), the steps, tokens emitted and seconds per (batch size, kind of step) as the step
gate saw them, beside HF batched ``generate`` on the same prompts (interleaved batch by batch).

Usage (from the repository root):
    python docs/results/session12-batch-mtbench-fp32-t0/step_account.py BATCH NEW_TOKENS PROMPTS
(``never`` steps are recorded under the kind the gate chose, though none drafted.)
"""

import sys
from collections import defaultdict

import torch

import draftheads.infer.generate as generate_module
from draftheads.base_model import load_base
from draftheads.bench import HFMethod, build_prompts, speculative_methods
from draftheads.infer.draft import root_only
from draftheads.infer.step_gate import StepGate

batch, new_tokens, limit = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
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


propose_rows = generate_module.propose_rows


def never(drafters, roots, positions, trees):
    return [root_only(root) for root in roots]


methods = {
    "hf": (HFMethod("generate", model, tokenizer), propose_rows),
    "gated": (speculative(pack=True), propose_rows),
    "never": (speculative(pack=False), never),
}
log = []
record = StepGate.record


def logged(self, rows, drafted, tokens, seconds, emitted=None, expected=None):
    log.append((id(self), rows, drafted, tokens if emitted is None else emitted, seconds))
    return record(self, rows, drafted, tokens, seconds, emitted, expected)


StepGate.record = logged
prompts = build_prompts("mt-bench", tokenizer, limit, None)
batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
for method, proposer in methods.values():  # warm-up, not timed
    generate_module.propose_rows = proposer
    method.run(batches[0], 16, 0.0, 0)
log.clear()
seconds, tokens = defaultdict(float), defaultdict(int)
for index, prompts_of_batch in enumerate(batches):
    for mode, (method, proposer) in methods.items():
        generate_module.propose_rows = proposer
        samples = method.run(prompts_of_batch, new_tokens, 0.0, index)
        seconds[mode] += sum(s.seconds for s in samples)
        tokens[mode] += sum(s.new_tokens for s in samples)
for mode in methods:
    print(
        f"{mode}: {tokens[mode]} tokens in {seconds[mode]:.2f} s, {tokens[mode] / seconds[mode]:.1f} tokens/s"
    )
for mode in ("gated", "never"):
    gate = id(methods[mode][0].generator.step_gate)
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for which, size, drafted, emitted, spent in log:
        if which == gate:
            entry = rows[(size, drafted)]
            entry[0] += 1
            entry[1] += emitted
            entry[2] += spent
    print(f"{mode}: the steps account for {sum(e[2] for e in rows.values()):.2f} s of {seconds[mode]:.2f} s")
    for (size, drafted), (steps, emitted, spent) in sorted(rows.items()):
        kind = "drafting" if drafted else "plain"
        print(
            f"   batch {size} {kind:8}: {steps:4d} steps, {emitted:6.0f} tokens, {spent:6.2f} s, "
            f"{emitted / spent:6.1f} tokens/s, {spent / steps * 1000:5.1f} ms/step"
        )
