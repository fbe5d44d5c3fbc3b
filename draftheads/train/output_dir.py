"""Taking ``train.output_dir`` for a run across its ranks: rank 0 checks it (``train/run_dir.py``),
locks it (``train/lock.py``) and claims it; every rank learns the outcome and checks that it sees
rank 0's files there."""

from __future__ import annotations

from pathlib import Path

import torch

from draftheads.config import TrainConfig
from draftheads.settings import ConfigError
from draftheads.train.lock import LOCK_NAME, OutputLock
from draftheads.train.run_dir import check_output_dir, claim_output_dir


def _lock_and_claim(train: TrainConfig, overwrite: bool) -> OutputLock:
    """Check ``train.output_dir`` (``train/run_dir.py``), lock it, check again under the lock (a
    run may have finished meanwhile) and mark it as this run's. The first check comes before the
    lock file is written, so a directory that is refused gains nothing."""
    output_dir = Path(train.output_dir)
    check_output_dir(output_dir, train.resume, overwrite)
    lock = OutputLock.acquire(output_dir)
    try:
        check_output_dir(output_dir, train.resume, overwrite)
        claim_output_dir(output_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def lock_output_dir(train: TrainConfig, overwrite: bool, rank: int, world_size: int) -> OutputLock | None:
    """Rank 0 checks, locks and claims ``train.output_dir`` for the run; every rank learns whether
    it could, so that all stop together, with rank 0's error, when it is refused or another run
    holds it. Returns rank 0's lock."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = _lock_and_claim(train, overwrite)
        except (ConfigError, FileExistsError) as err:  # OutputDirLockedError, OutputDirRefusedError
            refusal = err
    if world_size > 1:
        shared = [refusal]
        torch.distributed.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal is not None:
        raise refusal
    check_shared_output_dir(Path(train.output_dir), rank, world_size)
    return lock


def check_shared_output_dir(output_dir: Path, rank: int, world_size: int) -> None:
    """Every rank must see the files rank 0 writes under ``train.output_dir``: a checkpoint is
    committed by rank 0, which lists, hashes and renames the files each rank saved there, so ranks
    on nodes without one shared filesystem would leave checkpoints that cannot be resumed. Each
    rank reads rank 0's lock file (just written) and compares it with what rank 0 holds; any rank
    that cannot see it stops every rank with one line, before the base loads."""
    if world_size == 1:
        return
    lock_path = output_dir / LOCK_NAME
    expected = [lock_path.read_text() if rank == 0 else None]
    torch.distributed.broadcast_object_list(expected, src=0)
    seen = lock_path.read_text() if lock_path.is_file() else None
    blind = [None] * world_size
    torch.distributed.all_gather_object(blind, seen != expected[0])
    missing = [str(index) for index, is_blind in enumerate(blind) if is_blind]
    if missing:
        raise ConfigError(
            f"train.output_dir: rank(s) {', '.join(missing)} do not see {lock_path}, which rank 0 wrote; "
            "every rank must write checkpoints to one filesystem they all share (on several nodes, "
            "a network filesystem mounted at the same path)"
        )
