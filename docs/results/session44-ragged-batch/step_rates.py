"""Four rows, continuous batching, the first N MT-bench prompts (the head's tuned tree with context
drafts, adaptive, fp32 packed): padded rows with one tree size against ragged rows with one node
budget, alternating twice. From the step gate's record of every four-row step: drafting steps
(their tokens emitted and expected, their time), the steps that also caught the head up, plain
steps; and the verification forwards' sizes and times. With a second argument, both generators
measure their batch cost curves live instead of using the tuned ones. Needs the trial applied
(git apply ragged-rows.patch).

Run from the repository root: .venv/bin/python <this file> N [live]
"""

import statistics
import sys
import time

import draftheads.infer.generate as generate_module
from draftheads.bench import SpeculativeMethod, build_prompts
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.step_gate import StepGate
from draftheads.infer.tree import load_tuned_tree

HEAD = "runs/s40/heads/cont4"
steps, forwards = [], []


def main(limit: int, live: bool) -> None:
    ragged = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32")
    tree = load_tuned_tree(HEAD, ragged.model.dtype, ragged.model.device)
    padded = SpeculativeGenerator(
        ragged.model, ragged.head, ragged.tokenizer, tree=tree, context=True, adaptive=True, cost=ragged.cost
    )
    padded.batch_costs.update(ragged.batch_costs)
    if live:  # batch curves measured at the first step of each batch size
        for generator in (ragged, padded):
            generator.batch_costs = {1: generator.batch_costs[1]} if 1 in generator.batch_costs else {}
        print("batch costs cleared", ragged.batch_costs.keys())
    prompts = build_prompts("mt-bench", ragged.tokenizer, limit)
    can_run_ragged = generate_module.can_run_ragged
    for name, generator, can in [
        ("padded", padded, lambda model, cache: False),
        ("ragged", ragged, can_run_ragged),
    ] * 2:
        generate_module.can_run_ragged = can
        steps.clear()
        forwards.clear()
        started = time.perf_counter()
        stats = SpeculativeMethod(name, generator).run(prompts, 128, 0.0, 0, batch_size=4)
        total = time.perf_counter() - started
        tokens = sum(s.new_tokens for s in stats)
        drafting = [s for s in steps if s["batch"] == 4 and s["drafted"] and not s["catching_up"]]
        catching_up = [s for s in steps if s["batch"] == 4 and s["drafted"] and s["catching_up"]]
        plain = [s for s in steps if s["batch"] == 4 and not s["drafted"]]
        trees = [f for f in forwards if len(f[0]) == 4 and sum(f[0]) > 4]
        drafting_seconds = sum(s["seconds"] for s in drafting)
        plain_seconds = sum(s["seconds"] for s in plain)
        print(
            f"{name}: {tokens / total:.1f} tok/s {total:.1f} s; drafting {len(drafting)} steps "
            f"(+{len(catching_up)} catch-up, {sum(s['seconds'] for s in catching_up):.1f} s): "
            f"emitted {statistics.mean(s['emitted'] for s in drafting):.2f} "
            f"exp {statistics.mean(s['expected'] for s in drafting):.2f} "
            f"in {1000 * drafting_seconds / len(drafting):.1f} ms "
            f"-> {sum(s['emitted'] for s in drafting) / drafting_seconds:.1f} tok/s, "
            f"{drafting_seconds:.1f} s; "
            f"plain {len(plain)} {1000 * plain_seconds / len(plain):.1f} ms "
            f"-> {4 * len(plain) / plain_seconds:.1f} tok/s, {plain_seconds:.1f} s; "
            f"draft fwd: tokens {statistics.mean(sum(f[0]) for f in trees):.1f}, "
            f"{1000 * statistics.mean(f[1] for f in trees):.1f} ms; "
            f"cache len {statistics.mean(f[2] for f in forwards):.0f} max {max(f[2] for f in forwards)}",
            flush=True,
        )


def record(self, batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
    steps.append(
        {
            "batch": batch,
            "drafted": drafted,
            "seconds": seconds,
            "emitted": emitted,
            "expected": expected,
            "catching_up": catching_up,
        }
    )
    return gate_record(self, batch, drafted, tokens, seconds, emitted, expected, catching_up)


def timed_rows_forward(model, cache, tokens, *args, **kwargs):
    started = time.perf_counter()
    output = rows_forward(model, cache, tokens, *args, **kwargs)
    forwards.append(([t.numel() for t in tokens], time.perf_counter() - started, cache.get_seq_length()))
    return output


gate_record, rows_forward = StepGate.record, generate_module.rows_forward
StepGate.record = record
generate_module.rows_forward = timed_rows_forward

if __name__ == "__main__":
    main(int(sys.argv[1]), len(sys.argv) > 2)
