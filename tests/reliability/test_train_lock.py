"""Two `train` runs into one output directory: the second is refused before it writes anything,
naming the first; a killed run's lock is taken over with a warning."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from draftheads.train.lock import LOCK_NAME, OutputDirLockedError, OutputLock
from draftheads.train.loop import run_training
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")

HOLD_LOCK = (
    "import sys, time\n"
    "from draftheads.train.lock import OutputLock\n"
    "lock = OutputLock.acquire(sys.argv[1])\n"
    "print('locked', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def other_run(tmp_path):
    """Another process holding the lock on ``tmp_path / 'run'``, as a running `train` would."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "locked"
    yield process
    process.kill()
    process.wait()


def test_a_second_run_is_refused_naming_the_first_and_writes_nothing(tmp_path, tiny_llama, other_run):
    dataset = patterned_dataset()
    holder = rf"pid {other_run.pid} on host {socket.gethostname()}, started 20\d\d-"
    with pytest.raises(OutputDirLockedError, match=holder):
        run_training(short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset))
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == [LOCK_NAME]
    with pytest.raises(OutputDirLockedError, match="choose another train.output_dir"):
        OutputLock.acquire(tmp_path / "run")


def test_a_killed_runs_lock_is_taken_over_with_a_warning(tmp_path, tiny_llama, other_run):
    other_run.send_signal(signal.SIGKILL)
    other_run.wait()
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["pid"] == other_run.pid
    dataset = patterned_dataset()
    stale = rf"stale lock left by pid {other_run.pid} .*that process is no longer running"
    with pytest.warns(UserWarning, match=stale):
        summary = run_training(
            short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset)
        )
    assert summary.steps == 4
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""  # released: no holder named
    with OutputLock.acquire(tmp_path / "run") as lock:  # and free, without a warning
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_a_run_that_fails_in_setup_releases_the_lock(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    run = short_run(tmp_path / "run", "model.dtype=bfloat16", "train.precision=fp32")
    with pytest.raises(Exception, match="disagrees with model.dtype"):
        run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))
    OutputLock.acquire(tmp_path / "run").release()


def test_a_lock_this_process_dropped_unreleased_is_named_as_its_own(tmp_path):
    lock = OutputLock.acquire(tmp_path)
    os.close(lock._descriptor)  # the descriptor closed without release(): the file still names us
    with pytest.warns(UserWarning, match=rf"pid {os.getpid()} .*this process dropped it"):
        OutputLock.acquire(tmp_path).release()
