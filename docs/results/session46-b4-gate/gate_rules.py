"""Four rows under the step gate as shipped (each kind's rate an exponential moving average,
smoothing 0.2: about the last five steps), under a rule tried and not kept (``longer``: about the
last 30 steps, smoothing 0.03, a plain mean until a kind has that many, a probe weighing what the
steps since the last one of its kind would have), and with drafting forced at every step
(``draft``), alternating in one process, each from a fresh gate: all 80 MT-bench first turns at
most WIDTH at once (continuous batching), 128 new tokens, greedy, fp32 on the packed base, the
shipped head with its tuned tree, context drafts, adaptive (eagle3+context/adaptive), after the
bench's warm-up. Prints tokens/s, tau, and the WIDTH-row steps: drafting, plain, the longest plain
stretch.

Run from the repository root:
    .venv/bin/python <this file> WIDTH shipped|longer|draft [shipped|longer|draft ...]
"""

import sys
import time

from draftheads.bench import build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer import step_gate as step_gate_module

HEAD = "docs/results/heads/eagle3-corpus-all-cached-cont4"
SHIPPED_RECORD = step_gate_module.Throughput.record


def longer_record(self, tokens, seconds, smoothing, elapsed=1):
    """The tried rule: a step ``elapsed`` steps after the last of its kind weighs what ``elapsed``
    updates would have, and at least 1 / steps so far."""
    weight = max(1.0 - (1.0 - smoothing) ** elapsed, 1.0 / (self.steps + 1))
    self.tokens += weight * (tokens - self.tokens)
    self.seconds += weight * (seconds - self.seconds)
    self.steps += 1


def longer_gate() -> step_gate_module.StepGate:
    """A gate that tells each kind's average how many steps passed since its last step."""
    gate = step_gate_module.StepGate(smoothing=0.03)
    last: dict[tuple[int, bool], int] = {}  # (batch, drafted) -> the step of the last recorded
    seen: dict[int, int] = {}  # batch -> steps recorded
    record = gate.record

    def counted(batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
        seen[batch] = step = seen.get(batch, 0) + 1
        if not (drafted and catching_up):
            arm = gate.measured.setdefault((batch, drafted), step_gate_module.Throughput())
            arm.elapsed = step - last.get((batch, drafted), step - 1)
            last[(batch, drafted)] = step
        record(batch, drafted, tokens, seconds, emitted=emitted, expected=expected, catching_up=catching_up)

    gate.record = counted
    return gate


def run(generator, prompts, width: int, rule: str) -> None:
    if rule == "longer":
        step_gate_module.Throughput.record = lambda self, tokens, seconds, smoothing: longer_record(
            self, tokens, seconds, smoothing, getattr(self, "elapsed", 1)
        )
        generator.step_gate = longer_gate()
    else:
        step_gate_module.Throughput.record = SHIPPED_RECORD
        generator.step_gate = step_gate_module.StepGate()
        if rule == "draft":
            generator.step_gate.drafts = lambda batch: True
    generator.head_gate = None
    generator.generate(prompts, max_new_tokens=16, batch_size=width)  # the bench's warm-up
    kinds = []
    record = generator.step_gate.record

    def logged(batch, drafted, *args, **kwargs):
        if batch == width:
            kinds.append(drafted)
        record(batch, drafted, *args, **kwargs)

    generator.step_gate.record = logged
    started = time.perf_counter()
    result = generator.generate(prompts, max_new_tokens=128, batch_size=width)
    seconds = time.perf_counter() - started
    tokens = sum(row.stats.new_tokens for row in result.results)
    forwards = sum(row.stats.forward_passes for row in result.results)
    stretch = longest = 0
    for drafted in kinds:
        stretch = 0 if drafted else stretch + 1
        longest = max(longest, stretch)
    print(
        f"{rule}: {tokens / seconds:.1f} tokens/s, tau {tokens / forwards:.2f}; {width}-row steps: "
        f"{kinds.count(True)} drafting, {kinds.count(False)} plain, longest plain stretch {longest}",
        flush=True,
    )


def main(width: int, rules: list[str]) -> None:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=True, adaptive=True)
    prompts = [p.input_ids for p in build_prompts("mt-bench", generator.tokenizer, 80)]
    for rule in rules:
        run(generator, prompts, width, rule)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
