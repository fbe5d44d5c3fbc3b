"""The GPU user's path in one run of under 10 minutes on one GPU (``make gpu-smoke``).

1. ``deepspeed --num_gpus 1 $(which draftheads) train``: EAGLE-3 on the embedded SmolLM2, 30 steps
   (ZeRO-2, bf16), then resumed to 40; the log must continue at step 31.
2. The trained head's parameters are on the GPU in bf16 and its rotary tables fp32; 4 more steps
   in this process give the peak GPU memory, tokens/s and host syncs per optimizer step.
3. ``draftheads cache-features`` on 200 conversations, then 20 offline steps.
4. Greedy decoding with the trained head on the GPU in fp32 is the base's own greedy output.

Each check prints one line, ``ok: ...`` or ``FAILED: ...``; the exit status is the number of
failures. It needs the package installed with a CUDA build of torch (docs/gpu.md).
``--allow-cpu`` runs the same steps on the CPU (fp32, gloo), with the GPU-only checks skipped, to
try the script itself where no GPU is.

    python scripts/gpu_smoke.py --out /tmp/gpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_eagle3_cpu.yaml"
DRAFTHEADS = Path(sys.executable).with_name("draftheads")
DEEPSPEED = Path(sys.executable).with_name("deepspeed")
# A short EAGLE-3 run: 1,200 conversations of up to 192 tokens, micro-batch 8, no evaluation.
RUN = [
    "data.limit=1200",
    "data.validation_size=16",
    "train.epochs=null",
    "train.eval_every=0",
    "train.log_every=5",
    "train.save_every=10",
    "train.base_throughput_batches=0",
    "train.deepspeed_config=configs/deepspeed/zero2.json",
]
PROMPTS = ["Explain why the sky is blue.", "Write a Python function that reverses a list."]
NEW_TOKENS = 64


class Checks:
    def __init__(self):
        self.failures = 0

    def check(self, passed: bool, what: str) -> None:
        print(f"{'ok' if passed else 'FAILED'}: {what}", flush=True)
        self.failures += not passed


# What a run in this process (check_training_step) sets for its one-process group; a child that
# inherited them would take itself for a launched rank and reuse this process's port.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def run(command: list[str], log: Path) -> int:
    """``command`` from the repository root, its output to ``log``; its exit status."""
    started = time.perf_counter()
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    with log.open("w") as out:
        status = subprocess.run(
            command, cwd=ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    print(f"[{time.perf_counter() - started:.0f} s] {' '.join(command[:4])} ... -> {log}", flush=True)
    return status


def train_with_launcher(out: Path, steps: int, *extra: str) -> int:
    command = [str(DEEPSPEED), "--num_gpus", "1", str(DRAFTHEADS), "train", "--config", str(CONFIG)]
    options = [*RUN, f"train.output_dir={out / 'run'}", f"train.max_steps={steps}", *extra]
    return run([*command, *options], out / f"train-{steps}.log")


def logged_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step"] for record in records if "loss" in record]


def check_training_step(checks: Checks, out: Path, on_gpu: bool) -> None:
    """4 steps in this process, from the trained head: where its parameters live, the peak GPU
    memory, tokens/s and host syncs per optimizer step."""
    from draftheads.config import load_run_config
    from draftheads.train import loop
    from draftheads.train.host_syncs import HostSyncCounter
    from draftheads.train.setup import setup

    options = [*RUN, f"train.output_dir={out / 'step'}", "train.max_steps=4"]
    config = load_run_config(CONFIG, [*options, f"train.init_head={out / 'run' / 'head'}"])
    run_state = setup(config)
    try:
        head = run_state.recipe.head
        parameter = next(head.parameters())
        if on_gpu:
            checks.check(parameter.device.type == "cuda", f"head parameters on {parameter.device}")
            checks.check(parameter.dtype == torch.bfloat16, f"head parameters in {parameter.dtype}")
            torch.cuda.reset_peak_memory_stats()
        tables = [(name, t) for name, t in head.named_buffers() if name.endswith("inv_freq")]
        checks.check(
            bool(tables) and all(table.dtype == torch.float32 for _, table in tables),
            f"rotary tables fp32: {[(name, str(table.dtype)) for name, table in tables]}",
        )
        started = time.perf_counter()
        with HostSyncCounter() as syncs:
            loop.train_steps(run_state)
        seconds = time.perf_counter() - started
        tokens_per_second = run_state.tokens / max(run_state.train_seconds, 1e-9)
        print(f"training: {tokens_per_second:.0f} tokens/s over 4 steps ({seconds:.1f} s)")
        print(f"host syncs: {syncs.total / 4:.1f} per optimizer step ({dict(syncs.kinds)}, with logging)")
        if on_gpu:
            print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    finally:
        loop.cleanup(run_state)


def check_greedy_equality(checks: Checks, out: Path, device: str) -> None:
    """The trained head decodes the base's own greedy tokens in fp32 on ``device``."""
    from draftheads.infer.generate import SpeculativeGenerator

    generator = SpeculativeGenerator.from_pretrained(out / "run" / "head", dtype="float32", device=device)
    model, tokenizer = generator.model, generator.tokenizer
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(model.device)
        plain = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        result = generator.generate(ids, max_new_tokens=NEW_TOKENS)
        checks.check(
            result.new_tokens == plain,
            f"greedy speculative == greedy base on {device} ({prompt[:30]!r}, tau {result.stats.tau:.2f})",
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the runs and logs")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU where no GPU is")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.allow_cpu:
        print("no CUDA device: this is the GPU smoke run (--allow-cpu tries it on the CPU)", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"{args.out} exists: give a new directory", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if on_gpu else 'cpu'}")
    checks = Checks()
    checks.check(train_with_launcher(args.out, 30) == 0, "deepspeed launcher: 30 steps")
    checks.check(train_with_launcher(args.out, 40, "train.resume=true") == 0, "resumed to step 40")
    steps = logged_steps(args.out / "run")
    checks.check(steps[-1] == 40 and 35 in steps, f"the resumed log goes on to step 40: {steps}")
    check_training_step(checks, args.out, on_gpu)
    features = [*RUN, "data.limit=200", f"data.features={args.out / 'features'}"]
    cache = [str(DRAFTHEADS), "cache-features", "--config", str(CONFIG), *features, "--no-progress"]
    checks.check(run(cache, args.out / "cache.log") == 0, "cache-features: 200 conversations")
    offline = [str(DRAFTHEADS), "train", "--config", str(CONFIG), *features]
    offline += [f"train.output_dir={args.out / 'offline'}", "train.max_steps=20"]
    checks.check(run(offline, args.out / "offline.log") == 0, "20 offline steps from the cache")
    check_greedy_equality(checks, args.out, "cuda" if on_gpu else "cpu")
    shutil.rmtree(args.out / "features", ignore_errors=True)  # written by this run
    print(f"{checks.failures} check(s) failed" if checks.failures else "all checks passed")
    return checks.failures


if __name__ == "__main__":
    sys.exit(main())
