"""The ``draftheads`` console script leaves the process group before the process exits.

A rank that exits with its gloo group alive can abort in interpreter finalisation (SIGABRT,
"terminate called without an active exception") after its work is done: a two-rank training run
once failed that way after saving its head. Two plain processes (no launcher, which would
terminate the other rank as soon as one fails) run ``console_main`` over a stand-in command.
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from draftheads.distributed import free_port
from tests.train.distributed_launch import COLLECTIVE_TIMEOUT_SECONDS, ROOT, launch_environment

_RANK = """
import sys
import torch
import draftheads.cli as cli
from draftheads.distributed import join_process_group

rank, _, _ = join_process_group()  # gloo, DRAFTHEADS_DISTRIBUTED_TIMEOUT from the environment
failing_rank, failure = int(sys.argv[1]), sys.argv[2]


def command():
    if rank != failing_rank:
        return 0
    if failure == "raises":  # an error out of main, as with --debug
        raise ValueError("the command's error")
    return 1


cli.main = command
try:
    cli.console_main()
except BaseException as ended:
    status = ended.code if isinstance(ended, SystemExit) else type(ended).__name__
    print(f"rank {rank} exit {status} in group {torch.distributed.is_initialized()}", flush=True)
    raise
"""


def _two_ranks(failing_rank: int, failure: str = "returns 1") -> list[subprocess.CompletedProcess]:
    environment = {**launch_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(failing_rank), failure],
            cwd=ROOT,
            env={**environment, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        # A rank that waited for one that has gone would time out (the collective timeout) here.
        outputs = [process.communicate(timeout=COLLECTIVE_TIMEOUT_SECONDS) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [
        subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        for process, (stdout, stderr) in zip(processes, outputs, strict=True)
    ]


def test_ranks_that_finish_leave_the_group_together():
    results = _two_ranks(failing_rank=-1)
    for rank, result in enumerate(results):
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"rank {rank} exit 0 in group False" in result.stdout


@pytest.mark.parametrize("failure", ["returns 1", "raises"])
def test_a_rank_that_failed_leaves_at_once_and_the_other_says_so(failure):
    failed, finished = _two_ranks(failing_rank=0, failure=failure)
    status = "1" if failure == "returns 1" else "ValueError"
    assert failed.returncode == 1 and f"rank 0 exit {status} in group False" in failed.stdout
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert "rank 1 exit 1 in group False" in finished.stdout
    assert "draftheads: another process of this run failed before the end" in finished.stderr


def test_the_installed_script_is_console_main():
    """The fix is in the entry point: ``main`` alone (what tests call in-process) leaves nothing."""
    scripts = entry_points(group="console_scripts")
    assert scripts["draftheads"].value == "draftheads.cli:console_main"
