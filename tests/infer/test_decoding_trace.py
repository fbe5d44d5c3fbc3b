"""Drafting behaviour pinned on the real model: for every head kind on SmolLM2 (fp32, default kernels),
the tokens emitted and how many drafts each depth had accepted, step by step, as recorded in
``tests/fixtures/smollm2_decoding_traces.json``.

Greedy output equals ``generate`` whatever the drafter does, so that alone cannot tell a drafting
change apart; the acceptance counts can: a position off by one, a wrong mask or a different tree
shows up there at once. Sampling (T=1, seeded) pins the verifier's use of the random stream too.

Floating-point rounding differs between CPUs, and a near-tie in a draft ranking can then flip, so
counts (and sampled tokens) must be identical only on the CPU model the fixture was recorded on;
elsewhere every count must agree within a small tolerance. Re-record (after a deliberate change,
saying why in the commit): ``python tests/infer/test_decoding_trace.py --write``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from draftheads.heads import EagleConfig, MedusaConfig, MtpConfig, build_head, load_head
from draftheads.infer import SpeculativeGenerator
from draftheads.machine import cpu_flags, cpu_name

BASE = "smollm2-135m-instruct"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_decoding_traces.json"
TRAINED_EAGLE3 = "eagle3-smollm2"  # the shipped EAGLE-3 head, by its short name (draftheads.shipped)
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain recursion with an example.",
]
MAX_NEW_TOKENS = 40
# name -> (head: a config built with seed 0, or "trained"; tree; temperature)
CASES = {
    "medusa-cpu8": (MedusaConfig(num_heads=3), "cpu-8", 0.0),
    "eagle-dynamic": (EagleConfig(), "dynamic-cpu", 0.0),
    "mtp-cpu8": (MtpConfig(num_modules=2), "cpu-8", 0.0),
    "eagle3-trained-dynamic": ("trained", "dynamic-cpu", 0.0),
    "eagle3-trained-cpu8": ("trained", "cpu-8", 0.0),
    "eagle3-trained-dynamic-t1": ("trained", "dynamic-cpu", 1.0),
    # Untrained EAGLE and MTP heads are rarely accepted, but at T=1 the residual distribution the
    # verifier samples from after a rejection depends on every draft probability: pinned tokens pin
    # the drafts' distributions too.
    "medusa-cpu8-t1": (MedusaConfig(num_heads=3), "cpu-8", 1.0),
    "eagle-dynamic-t1": (EagleConfig(), "dynamic-cpu", 1.0),
    "mtp-cpu8-t1": (MtpConfig(num_modules=2), "cpu-8", 1.0),
}
TOLERANCE = 3  # accepted drafts per depth, summed over the prompts, on another CPU model
# ``make test`` keeps the shipped head's greedy traces (tokens and per-depth acceptance on the real
# tree shapes); the untrained heads' traces and every sampled trace run in ``make test-all``.
FAST_CASES = ("eagle3-trained-dynamic", "eagle3-trained-cpu8")


def cpu_model() -> str:
    """The CPU's model name and the vector extensions that change which kernels run."""
    return f"{cpu_name()} [{' '.join(cpu_flags())}]"


def trace(model, tokenizer, case: str) -> list[dict]:
    spec, tree, temperature = CASES[case]
    if spec == "trained":
        head = load_head(TRAINED_EAGLE3, base_model=model)
    else:
        torch.manual_seed(0)
        head = build_head(model, spec, BASE)
    generator = SpeculativeGenerator(model, head, tokenizer, tree=tree)
    out = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        result = generator.generate(messages, max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, seed=0)
        out.append(
            {
                "tokens": result.new_tokens,
                "verification_steps": result.stats.verification_steps,
                "accepted_per_depth": list(result.stats.accepted_per_depth),
            }
        )
    return out


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.integration
@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=() if case in FAST_CASES else pytest.mark.slow) for case in CASES]
)
def test_decoding_trace_unchanged(smollm2, case):
    model, tokenizer = smollm2
    recorded = json.loads(FIXTURE.read_text())
    expected = recorded["cases"][case]
    actual = trace(model, tokenizer, case)
    greedy = CASES[case][2] == 0.0
    same_cpu = recorded["cpu_model"] == cpu_model()
    for question, want, got in zip(QUESTIONS, expected, actual):
        if greedy or same_cpu:
            assert got["tokens"] == want["tokens"], question
        if same_cpu:
            assert got["accepted_per_depth"] == want["accepted_per_depth"], question
            assert got["verification_steps"] == want["verification_steps"], question
    if not same_cpu and greedy:
        depth = max(len(t["accepted_per_depth"]) for t in expected + actual)

        def totals(traces):
            return [sum((t["accepted_per_depth"] + [0] * depth)[d] for t in traces) for d in range(depth)]

        assert all(abs(a - b) <= TOLERANCE for a, b in zip(totals(actual), totals(expected)))


if __name__ == "__main__":  # re-record: python tests/infer/test_decoding_trace.py --write
    from draftheads.base_model import load_base

    torch.set_num_threads(1)
    model, tokenizer = load_base(BASE, dtype="float32")
    cases = {case: trace(model, tokenizer, case) for case in CASES}
    text = json.dumps({"cpu_model": cpu_model(), "cases": cases}, indent=1) + "\n"
    if "--write" in sys.argv:
        FIXTURE.write_text(text)
        print(f"wrote {FIXTURE}")
    else:
        print(text)
