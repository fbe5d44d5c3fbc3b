"""Speedups by the machine's speed: a bench run's prompts in quarters by their probe (the one-token
forward ``draftheads bench`` times around every batch), fastest quarter first; per quarter the
probe's mean, plain generate's tokens/s and each method's speedup over those prompts.

Run from the repository root:
    .venv/bin/python docs/results/session50-speed-probe/by_probe.py RUN_DIR [RUN_DIR ...]
"""

import json
import sys
from pathlib import Path

REFERENCE = "generate"


def probe(sample: dict) -> float:
    """The sample's probe: ``probe_seconds`` (the first form, one per prompt), or the slowest of its
    repeats' ``repeat_probe_seconds``."""
    return sample["probe_seconds"] if "probe_seconds" in sample else max(sample["repeat_probe_seconds"])


def rate(samples: list[dict]) -> float:
    return sum(s["new_tokens"] for s in samples) / sum(s["seconds"] for s in samples)


def main(run_dir: Path) -> None:
    record = json.loads((run_dir / "bench.json").read_text())
    by_prompt: dict[str, dict[str, dict]] = {}
    for sample in record["samples"]:
        by_prompt.setdefault(sample["prompt_id"], {})[sample["method"]] = sample
    prompts = sorted(by_prompt.values(), key=lambda methods: probe(methods[REFERENCE]))
    methods = [m for m in prompts[0] if m != REFERENCE]
    print(f"{run_dir}: {len(prompts)} prompts")
    for quarter in range(4):
        part = prompts[quarter * len(prompts) // 4 : (quarter + 1) * len(prompts) // 4]
        mean = sum(probe(p[REFERENCE]) for p in part) / len(part)
        plain = rate([p[REFERENCE] for p in part])
        speedups = ", ".join(f"{m} {rate([p[m] for p in part]) / plain:.2f}x" for m in methods)
        print(
            f"  quarter {quarter + 1}: probe {1e3 * mean:.2f} ms, generate {plain:.1f} tokens/s, {speedups}"
        )


if __name__ == "__main__":
    for name in sys.argv[1:]:
        main(Path(name))
