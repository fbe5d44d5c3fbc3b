"""StepGate trace on the first N MT-bench prompts (one generator, as the bench), R runs: for every
drafting step outside long drafting runs, (tokens expected, emitted, ms) and the two rates after it.
Usage: python gate_trace.py N R

Each step of a prompt's line: "." a plain step; "C" a drafting step whose head first caught up on
skipped tokens (not measured), "D" a measured drafting step, each as expected/emitted tokens:ms,
then [drafting rate x correction | plain rate | correction] in tokens/s after it. Runs of four
plain steps are printed as "....". gate_trace_before.txt ran at commit 3d4cab2 (the correction
summed over every step), gate_trace_after.txt at 8178100 (the fading correction)."""

import sys

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.step_gate import StepGate

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont2"
trace = []
rec = StepGate.record


def rec_w(self, batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
    rec(self, batch, drafted, tokens, seconds, emitted, expected, catching_up)
    d, p = self.measured.get((batch, True)), self.measured.get((batch, False))
    trace.append(
        (
            drafted,
            tokens,
            emitted,
            seconds * 1e3,
            catching_up,
            d.rate * self.correction if d else 0,
            p.rate if p else 0,
            self.correction,
        )
    )


StepGate.record = rec_w
for run in range(int(sys.argv[2])):
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    prompts = build_prompts("mt-bench", generator.tokenizer, int(sys.argv[1]))
    for i, p in enumerate(prompts):
        trace.clear()
        s = generator.generate(p.input_ids, max_new_tokens=128).stats
        out = []
        for t in trace:
            if t[0]:
                out.append(
                    f"{'C' if t[4] else 'D'}{t[1]:.1f}/{t[2]}:{t[3]:.0f}ms[{t[5]:.0f}|{t[6]:.0f}|{t[7]:.2f}]"
                )
            else:
                out.append(".")
        print(
            f"run {run} prompt {i} tau {s.tau:.2f}: " + " ".join(out).replace(". . . . ", "...."), flush=True
        )
