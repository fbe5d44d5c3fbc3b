"""Resuming a run with another number of data-parallel processes (2 GPUs -> 1, 1 -> 8).

A ZeRO checkpoint holds each rank's partition of the optimizer state (ZeRO-1/2, and the bf16
optimizer at stage 0) and of the weights (ZeRO-3), which only the same number of ranks can read.
For another number, rank 0 converts the checkpoint's engine state into DeepSpeed's universal
checkpoint format (``deepspeed.checkpoint.ds_to_universal``: each parameter's fp32 weights and
Adam moments whole, one folder per parameter), which an engine built with ``"checkpoint":
{"load_universal": true}`` reads at any world size and partitions anew (Lian et al. 2024,
"Universal Checkpointing", arXiv:2406.18820). An fp32 ZeRO-0 checkpoint is not partitioned and
loads as it is. The conversion goes to a temporary folder beside the checkpoint, removed once
every rank has loaded it; the checkpoint itself is only read.

The data position carries over as a count of global micro-batches: every rank reads one
micro-batch per accumulation step, so W ranks that each read k have consumed k * W, which W'
ranks continue as k * W / W' each (``BatchStream``: the k-th micro-batch of rank r is global
micro-batch k * W + r whatever W is). A resume that keeps the global batch (micro-batch x
accumulation x ranks) therefore reads what the uninterrupted run would have read next.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftheads.settings import ConfigError

UNIVERSAL_PREFIX = "universal-"  # the converted folder: TEMP_PREFIX + this + the checkpoint's name
CONVERSION_LOG = "conversion.log"


def written_world_size(trainer_state: dict[str, Any]) -> int:
    """How many data-parallel processes wrote a checkpoint (its data position records it)."""
    return int(trainer_state.get("data_position", {}).get("world_size", 1))


def is_partitioned(engine_dir: Path) -> bool:
    """Whether DeepSpeed saved the optimizer state in per-rank partitions (``*optim_states.pt``)."""
    return any(engine_dir.glob("*optim_states.pt"))


def global_batch(train: dict[str, Any], world_size: int) -> int:
    """Rows per optimizer step over all ranks, from a run record's ``train`` section."""
    return int(train["micro_batch_size"]) * int(train["gradient_accumulation_steps"]) * world_size


def align_accumulation(saved: dict, record: dict, written: int, world_size: int) -> dict:
    """``saved`` (a checkpoint's run record) with ``record``'s gradient accumulation when the
    change of world size and accumulation keeps the global batch: that is not a change of the
    batches the run reads (the module docstring), so it needs no ``--allow-changed-data``."""
    if written == world_size or global_batch(saved["train"], written) != global_batch(
        record["train"], world_size
    ):
        return saved
    if saved["train"]["micro_batch_size"] != record["train"]["micro_batch_size"]:
        return saved
    steps = record["train"]["gradient_accumulation_steps"]
    return {**saved, "train": {**saved["train"], "gradient_accumulation_steps": steps}}


def remap_data_position(position: dict[str, int], world_size: int, where: str) -> dict[str, int]:
    """A data position counted by ``position["world_size"]`` ranks, counted by ``world_size``."""
    consumed = int(position["micro_batches_read"]) * int(position["world_size"])
    if consumed % world_size:
        raise ConfigError(
            f"train.resume: {where}: its ranks read {consumed} micro-batches in all, which "
            f"{world_size} processes cannot split evenly; resume with a number of processes that "
            f"divides {consumed}"
        )
    return {"micro_batches_read": consumed // world_size, "world_size": world_size}


def universal_folder(checkpoint: Path, temp_prefix: str) -> Path:
    """Where ``checkpoint``'s universal conversion goes (beside it, a temporary name that the
    next checkpoint save clears if a crash left it)."""
    return checkpoint.parent / f"{temp_prefix}{UNIVERSAL_PREFIX}{checkpoint.name}"


def convert_to_universal(checkpoint: Path, engine_tag: str, output: Path) -> None:
    """Convert ``checkpoint/engine_tag`` into ``output/engine_tag`` (universal format) with
    DeepSpeed's converter, in a child process; its output goes to ``output/conversion.log``.
    ``--inject_missing_state`` supplies the format version ZeRO-1/2 checkpoints do not record."""
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(checkpoint / engine_tag),
        "--output_folder",
        str(output / engine_tag),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        "--inject_missing_state",
    ]
    log = output / CONVERSION_LOG
    with log.open("w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        last = (log.read_text().strip().splitlines() or ["no output"])[-1]
        raise ConfigError(
            f"train.resume: converting {checkpoint} for another number of processes failed ({last}); "
            f"the converter's output is in {log}"
        )
