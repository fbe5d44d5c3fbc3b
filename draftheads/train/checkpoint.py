"""Atomic, resumable training checkpoints.

Layout under ``<output_dir>/checkpoints/``::

    step-00000200/
        engine/...               DeepSpeed engine state: head weights, optimizer (ZeRO partitions
                                 per rank), LR scheduler
        rng_state_<rank>.pt      torch / CUDA / python / numpy RNG of each rank
        trainer_state.json       step, data position, token count, last evaluation (written last)

A checkpoint is written into ``.tmp-step-...`` and renamed into place only once complete, so a
crash leaves either the previous checkpoints or the new one, never a half-written directory that
``resume`` would pick up. Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS_DIR = "checkpoints"
ENGINE_TAG = "engine"
STATE_NAME = "trainer_state.json"
TEMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those holding ``trainer_state.json``), oldest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.match(path.name)) and (path / STATE_NAME).is_file()
    ]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_NAME).read_text())


# ---- RNG ------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


# ---- save / load ----------------------------------------------------------------------------------


def _barrier() -> None:
    from torch import distributed

    if distributed.is_available() and distributed.is_initialized():
        distributed.barrier()


def _remove_stale_temporaries(root: Path) -> None:
    for path in root.glob(TEMP_PREFIX + "*"):
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    engine,
    output_dir: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    keep: int,
    rank: int = 0,
    exclude_frozen: bool = False,
) -> Path:
    """Write checkpoint ``step`` atomically on every rank (all ranks must call) and prune old ones.

    Args:
        engine: a DeepSpeed engine (anything with ``save_checkpoint(dir, tag=..., ...)``).
        trainer_state: JSON-serialisable loop state (step, data position, evaluation, ...).
        keep: how many checkpoints to keep (the newest; at least 1).
        exclude_frozen: leave frozen parameters out of the engine state (Medusa-2: the engine's
            module holds the whole base, of which only the LoRA adapter trains).
    """
    root = Path(output_dir) / CHECKPOINTS_DIR
    final = root / checkpoint_name(step)
    temporary = root / (TEMP_PREFIX + checkpoint_name(step))
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
    _barrier()
    try:
        options = {"exclude_frozen_parameters": True} if exclude_frozen else {}
        engine.save_checkpoint(str(temporary), tag=ENGINE_TAG, save_latest=False, **options)
        torch.save(capture_rng_state(), temporary / f"rng_state_{rank}.pt")
        _barrier()
        if rank == 0:
            (temporary / STATE_NAME).write_text(json.dumps({**trainer_state, "step": step}, indent=2) + "\n")
            if final.exists():  # re-saving a step (e.g. the final save right after a periodic one)
                shutil.rmtree(final)
            os.replace(temporary, final)
            for old in list_checkpoints(output_dir)[: -max(1, keep)]:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    _barrier()
    return final


def load_checkpoint(
    engine, checkpoint: str | Path, rank: int = 0, exclude_frozen: bool = False
) -> dict[str, Any]:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG; return trainer state.
    ``exclude_frozen``: the checkpoint was saved without frozen parameters (they stay as loaded)."""
    checkpoint = Path(checkpoint)
    state_path = checkpoint / STATE_NAME
    if not state_path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no {STATE_NAME})")
    load_path, _ = engine.load_checkpoint(
        str(checkpoint),
        tag=ENGINE_TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_strict=not exclude_frozen,
    )
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no engine state under {checkpoint / ENGINE_TAG}")
    rng_path = checkpoint / f"rng_state_{rank}.pt"
    if not rng_path.is_file():
        raise FileNotFoundError(
            f"{rng_path} is missing: the checkpoint was written with fewer ranks than this run uses"
        )
    restore_rng_state(torch.load(rng_path, weights_only=False))
    return json.loads(state_path.read_text())
