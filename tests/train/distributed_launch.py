"""Shared by the multi-process training tests: a tiny base model and conversations on disk, and
``draftheads train`` launched as N gloo processes (``python -m torch.distributed.run``), one
intra-op thread each.

Imported by name (pytest puts this folder on sys.path); not a conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftheads.base_model import load_tokenizer
from tests.train.tiny_runs import HEAD_OVERRIDES as TINY_HEADS

ROOT = Path(__file__).resolve().parents[2]
DRAFTHEADS = Path(sys.executable).with_name("draftheads")  # the console script of this environment
LAUNCH_TIMEOUT_SECONDS = 300  # one launch of a few steps takes ~20-60 s on a shared 2-core CPU
COLLECTIVE_TIMEOUT_SECONDS = 60  # DRAFTHEADS_DISTRIBUTED_TIMEOUT in the launched processes
# Set by an in-process run (init_distributed) or a parent launcher; a child launch sets its own.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)

HEAD_OVERRIDES = {
    **TINY_HEADS,
    "medusa2": [
        "head.kind=medusa",
        "head.num_heads=2",
        "head.joint=true",
        "joint.lora_rank=4",
        "joint.lora_alpha=8",
        "joint.base_loss=lm",
    ],
}


def write_tiny_base(directory: Path, conversations: Path) -> Path:
    """A 4-layer random Llama with SmolLM2's tokenizer (and chat template), saved to ``directory``.

    Its lm_head is sharpened (peaked next-token distributions, so soft-target losses can move) and
    predicts only tokens of ``conversations``: EAGLE-3 scores a position only when the base's
    argmax is in its small draft vocabulary, which a random 49k-token head would almost never be.
    """
    from tests.conftest import make_tiny_llama

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = make_tiny_llama(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    used = torch.zeros(len(tokenizer), dtype=torch.bool)
    for line in conversations.read_text().splitlines():
        for turn in json.loads(line)["conversations"]:
            used[tokenizer(turn["value"])["input_ids"]] = True
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[~used] = 0.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_conversations(path: Path, count: int = 26, varied_lengths: bool = False) -> Path:
    """``count`` ShareGPT records whose answers count up by a per-record stride (predictable).

    Each answer has 12 numbers (every record fills ``data.max_length=64``), or with
    ``varied_lengths`` 2-6 numbers (records of 45-67 tokens: a batch pads its shorter rows, and
    a row's padded length depends on the batch it lands in).
    """
    with path.open("w") as out:
        for index in range(count):
            stride, start = 1 + index % 3, 3 + 7 * index
            numbers = 2 + index % 5 if varied_lengths else 12
            answer = " ".join(str(start + stride * j) for j in range(numbers))
            record = {
                "id": f"c{index}",
                "conversations": [
                    {"from": "human", "value": f"Count from {start} in steps of {stride}."},
                    {"from": "gpt", "value": answer},
                ],
            }
            out.write(json.dumps(record) + "\n")
    return path


def run_options(base: Path, data: Path, output_dir: Path, kind: str, zero: int, *extra: str) -> list[str]:
    """``key=value`` overrides for a short run: micro-batch 2, 6 steps, a checkpoint every 3, the
    shipped EAGLE-3 loss_token_fraction of 0.25 (the sampled tokens must not depend on the rank)."""
    return [
        f"model.base={base}",
        f"data.source={data}",
        "data.max_length=64",
        "data.validation_size=2",
        f"data.cache_dir={output_dir.parent / 'datasets'}",
        *HEAD_OVERRIDES[kind],
        f"train.output_dir={output_dir}",
        "train.max_steps=6",
        "train.micro_batch_size=2",
        "train.learning_rate=1e-2",
        "train.warmup_steps=1",
        "train.log_every=1",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.save_every=3",
        "train.keep_checkpoints=3",
        "train.base_throughput_batches=0",
        "train.loss_token_fraction=0.25",
        f"train.deepspeed_config=configs/deepspeed/zero{zero}.json",
        *extra,
    ]


def launch_environment() -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    environment.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        DRAFTHEADS_DISTRIBUTED_TIMEOUT=str(COLLECTIVE_TIMEOUT_SECONDS),
        PYTHONPATH=os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")]),
    )
    return environment


def run_launcher(command: list[str]) -> subprocess.CompletedProcess:
    """A launcher ``command`` from the repository root, in the launch environment, its output kept."""
    return subprocess.run(
        command,
        cwd=ROOT,
        env=launch_environment(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_SECONDS,
        check=False,
    )


def launch(processes: int, program: list[str]) -> subprocess.CompletedProcess:
    """``program`` (a Python script and its arguments) as ``processes`` ranks under torchrun."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        *program,
    ]
    return run_launcher(command)


def launch_with_deepspeed(processes: int, options: list[str], config: Path) -> subprocess.CompletedProcess:
    """``draftheads train --config config options`` as ``processes`` ranks started by DeepSpeed's
    own launcher, as the docs' launch line does: each rank runs ``draftheads --local_rank=N train
    ...`` (the flag before the command), on the CPU accelerator with gloo."""
    from draftheads.distributed import free_port

    command = [
        str(Path(sys.executable).with_name("deepspeed")),
        f"--num_gpus={processes}",
        f"--master_port={free_port()}",
        str(DRAFTHEADS),
        "train",
        "--config",
        str(config),
        *options,
    ]
    return run_launcher(command)


def launch_train(processes: int, options: list[str], config: Path) -> subprocess.CompletedProcess:
    """``draftheads train --config config options`` as ``processes`` ranks."""
    return launch(processes, [str(DRAFTHEADS), "train", "--config", str(config), *options])


def launch_parameter_dump(
    processes: int, options: list[str], config: Path, out: Path
) -> subprocess.CompletedProcess:
    """Train like ``draftheads train``, then write each rank's trainable parameters to
    ``out/rank<r>.pt`` (``dump_trained_parameters``)."""
    return launch(processes, [__file__, str(out), str(config), *options])


def dump_trained_parameters(out: Path, config: Path, options: list[str]) -> None:
    """setup -> train_steps, then this rank's trainable parameters (as the rank holds them after
    the last step) to ``out/rank<r>.pt``; then leave the process group as the console script does."""
    from draftheads.config import load_run_config
    from draftheads.distributed import leave_process_group
    from draftheads.train.loop import cleanup, train_steps
    from draftheads.train.setup import setup

    run = setup(load_run_config(config, options))
    finished = False
    try:
        train_steps(run)
        trained = {
            name: parameter.detach().clone()
            for name, parameter in run.recipe.named_parameters()
            if parameter.requires_grad
        }
        torch.save(trained, out / f"rank{run.rank}.pt")
        finished = True
    finally:
        try:
            cleanup(run)
        finally:
            leave_process_group(finished)


def empty_config(directory: Path) -> Path:
    """A run config file with nothing in it (every setting comes from the overrides)."""
    path = directory / "run.yaml"
    path.write_text("# settings come from the command line's key=value overrides\n{}\n")
    return path


def head_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "head" / "model.safetensors"))


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b| (the issue's measure)."""
    if a.keys() != b.keys():
        raise AssertionError(f"different tensors: {sorted(a.keys() ^ b.keys())}")
    differences = [0.0]
    for name, ours in a.items():
        theirs = b[name]
        if not ours.is_floating_point():  # e.g. EAGLE-3's vocabulary maps: equal or not
            differences.append(0.0 if torch.equal(ours, theirs) else float("inf"))
            continue
        scale = theirs.abs().max().clamp(min=1e-12)
        differences.append(float((ours - theirs).abs().max() / scale))
    return max(differences)


if __name__ == "__main__":
    dump_trained_parameters(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
