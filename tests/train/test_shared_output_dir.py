"""Every rank must see rank 0's files under train.output_dir (rank 0 commits every checkpoint):
ranks on separate disks are stopped at start with one line naming the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import multiprocessing

from draftheads.settings import ConfigError
from draftheads.train.lock import OutputLock
from draftheads.train.output_dir import check_shared_output_dir


def _rank(rank: int, store_file: str, directories: list[str], results: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=len(directories)
    )
    try:
        directory = Path(directories[rank])
        lock = OutputLock.acquire(directory) if rank == 0 else None
        torch.distributed.barrier()
        try:
            check_shared_output_dir(directory, rank, len(directories))
            outcome = "ok"
        except ConfigError as err:
            outcome = str(err)
        Path(results, f"rank{rank}").write_text(outcome)
        torch.distributed.barrier()
        if lock is not None:
            lock.release()
    finally:
        torch.distributed.destroy_process_group()


def _check(tmp_path: Path, directories: list[Path]) -> list[str]:
    results = tmp_path / "results"
    results.mkdir()
    multiprocessing.spawn(
        _rank,
        args=(str(tmp_path / "store"), [str(d) for d in directories], str(results)),
        nprocs=len(directories),
    )
    return [(results / f"rank{rank}").read_text() for rank in range(len(directories))]


@pytest.mark.parametrize("shared", [True, False])
def test_ranks_that_do_not_share_the_output_directory_are_stopped(tmp_path, shared):
    run_dir = tmp_path / "run"
    other_disk = tmp_path / "node-b" / "run"  # the same path on another node's own disk
    other_disk.mkdir(parents=True)
    outcomes = _check(tmp_path, [run_dir, run_dir if shared else other_disk])
    if shared:
        assert outcomes == ["ok", "ok"]
    else:
        for outcome in outcomes:  # every rank stops, with the same line
            assert outcome.startswith("train.output_dir: rank(s) 1 do not see")
