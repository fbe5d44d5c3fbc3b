"""Resuming a run from its output directory: which checkpoint (the newest intact one), and
putting the engine, the data position and the loop's counters back where it left them."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch

from draftheads.settings import ConfigError
from draftheads.train import checkpoint, elastic
from draftheads.train.metrics import EvalResult
from draftheads.train.reporting import log_rank0
from draftheads.train.training_run import TrainingRun


def choose_resume_checkpoint(output_dir: Path, rank: int, world_size: int) -> Path | None:
    """The newest intact checkpoint under ``output_dir`` (None: there is none). Rank 0 verifies
    them against their manifests and sets broken ones aside, with a warning naming each and why;
    every rank gets its answer. No intact checkpoint at all is a ConfigError."""
    answer = [None, None]  # (checkpoint path, refusal)
    if rank == 0:
        try:
            point = checkpoint.find_resume_checkpoint(output_dir)
        except checkpoint.CorruptCheckpointError as err:
            answer = [None, f"train.resume: {err}"]
        else:
            for path, why in point.skipped:
                aside = checkpoint.set_aside(path)
                warnings.warn(
                    f"train.resume: checkpoint {path} is broken ({why}); moved to {aside.name} and "
                    "resuming from the newest intact one",
                    stacklevel=2,
                )
            if point.path is not None and not point.verified:
                warnings.warn(
                    f"train.resume: {point.path} has no {checkpoint.MANIFEST_NAME} (written before "
                    "checkpoints carried one), so it cannot be verified; loading it as it is",
                    stacklevel=2,
                )
            answer = [None if point.path is None else str(point.path), None]
    if world_size > 1:
        torch.distributed.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise ConfigError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def needs_universal_load(path: Path, world_size: int) -> bool:
    """Whether checkpoint ``path`` was partitioned by another number of processes than
    ``world_size``, so that it loads only through a universal conversion (``train/elastic.py``)."""
    written = elastic.written_world_size(checkpoint.read_trainer_state(path))
    return written != world_size and elastic.is_partitioned(path / checkpoint.ENGINE_TAG)


def load_engine_state(run: TrainingRun, path: Path) -> dict:
    """``checkpoint.load_checkpoint`` for this run; a checkpoint partitioned by another number of
    processes is first converted by rank 0 into a temporary universal folder beside it, which
    every rank loads and rank 0 then removes."""
    exclude_frozen = run.recipe.exclude_frozen
    if not needs_universal_load(path, run.world_size):
        return checkpoint.load_checkpoint(run.engine, path, run.rank, exclude_frozen=exclude_frozen)
    universal = elastic.universal_folder(path, checkpoint.TEMP_PREFIX)
    failure = [None]
    if run.rank == 0:
        log_rank0(run.rank, f"train.resume: converting {path} for {run.world_size} process(es)")
        try:
            elastic.convert_to_universal(path, checkpoint.ENGINE_TAG, universal)
        except ConfigError as err:
            failure = [str(err)]
    if run.world_size > 1:
        torch.distributed.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise ConfigError(failure[0])
    try:
        return checkpoint.load_checkpoint(
            run.engine, path, run.rank, exclude_frozen=exclude_frozen, engine_root=universal
        )
    finally:
        if run.world_size > 1:
            torch.distributed.barrier()
        if run.rank == 0:
            shutil.rmtree(universal, ignore_errors=True)


def restore(run: TrainingRun, path: Path, restart_data: bool = False) -> None:
    """Continue from checkpoint ``path``: engine, RNG, data position and loop counters.
    ``restart_data``: the data or batches changed, so the saved position means nothing for them:
    the stream starts at the beginning of the new data."""
    state = load_engine_state(run, path)
    if restart_data:
        log_rank0(run.rank, "train.resume: data or batches changed; the data stream starts over")
    else:
        position = state["data_position"]
        if elastic.written_world_size(state) != run.world_size:
            position = elastic.remap_data_position(position, run.world_size, str(path))
        run.stream.load_state_dict(position)
    run.step, run.tokens = state["step"], state["tokens"]
    run.train_seconds = state["train_seconds"]
    run.last_eval = EvalResult.from_dict(state["eval"]) if state["eval"] else None
    run.last_eval_step = state["eval_step"]
    log_rank0(run.rank, f"resumed from {path} at step {run.step}")
