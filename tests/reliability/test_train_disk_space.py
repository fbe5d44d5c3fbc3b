"""A full disk during training: refused up front (or, when the estimate was short, reported as
what it is) with the free space named, and no half-written checkpoint or head left behind."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftheads.storage import InsufficientSpaceError
from draftheads.train import checkpoint
from draftheads.train.lock import OutputLock
from draftheads.train.loop import cleanup, run_training, save, train_steps
from draftheads.train.setup import setup
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")


def small_disk(directory: Path, size: str) -> Path:
    """A tmpfs of ``size`` at ``directory`` (root only: skip elsewhere)."""
    directory.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"cannot mount a small tmpfs here: {err}")
    return directory


@pytest.fixture
def disk(tmp_path):
    mounted = []

    def make(size: str) -> Path:
        mounted.append(small_disk(tmp_path / f"disk{len(mounted)}", size))
        return mounted[-1]

    yield make
    for directory in mounted:
        subprocess.run(["umount", "-l", str(directory)], check=False)


class BigWriter:
    """An engine whose checkpoint is far larger than its weights and optimizer state suggest (so
    the free-space check passes and the write itself hits the full disk)."""

    def __init__(self, megabytes: int):
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = None
        self.megabytes = megabytes

    def save_checkpoint(self, directory, tag, save_latest=True, **options):
        path = Path(directory) / tag
        path.mkdir(parents=True)
        torch.save(torch.zeros(self.megabytes * 2**18), path / "model.pt")  # float32: 4 bytes each


def test_training_onto_a_nearly_full_disk_is_refused_with_the_free_space(disk, tiny_llama):
    output_dir = disk("800k") / "run"  # room for a few files, not for a 0.5 MiB checkpoint
    dataset = patterned_dataset()
    with pytest.raises(InsufficientSpaceError, match=r"for checkpoint step-00000002: needs .* KiB free"):
        run_training(short_run(output_dir), base_model=tiny_llama, datasets=(dataset, dataset))
    assert not list((output_dir / "checkpoints").iterdir())  # no half checkpoint, no temporary
    OutputLock.acquire(output_dir).release()  # and the run let go of its directory


def test_a_write_that_fills_the_disk_says_so_and_keeps_the_previous_checkpoint(disk):
    output_dir = disk("5m")
    checkpoint.save_checkpoint(BigWriter(1), output_dir, 10, {}, keep=3)
    with pytest.raises(InsufficientSpaceError, match=r"ran out of space .* writing checkpoint step-00000020"):
        checkpoint.save_checkpoint(BigWriter(6), output_dir, 20, {}, keep=3)
    assert [path.name for path in (output_dir / "checkpoints").iterdir()] == ["step-00000010"]
    assert checkpoint.verify_checkpoint(checkpoint.latest_checkpoint(output_dir))


def test_a_head_write_that_fills_the_disk_says_so(disk):
    directory = disk("1m")
    temporary = directory / ".tmp-head"
    with (
        pytest.raises(InsufficientSpaceError, match=r"ran out of space .* writing the head"),
        checkpoint.space_checked_write(directory, temporary, 2**10, "the head"),
    ):
        temporary.mkdir()
        save_file({"weight": torch.zeros(2**19)}, str(temporary / "model.safetensors"))


def test_enospc_from_any_writer_becomes_the_clear_error(tmp_path, monkeypatch):
    class FullDisk(BigWriter):
        def save_checkpoint(self, directory, tag, save_latest=True, **options):
            Path(directory, tag).mkdir(parents=True)
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(InsufficientSpaceError, match="ran out of space") as caught:
        checkpoint.save_checkpoint(FullDisk(1), tmp_path, 10, {}, keep=3)
    assert caught.value.errno == errno.ENOSPC
    assert not list((tmp_path / "checkpoints").iterdir())
    # The check before writing uses the previous checkpoint's size when it is the larger.
    checkpoint.save_checkpoint(BigWriter(2), tmp_path, 10, {}, keep=3)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=2 * 2**20))
    with pytest.raises(InsufficientSpaceError, match=r"for checkpoint step-00000020: needs 3.2 MiB"):
        checkpoint.save_checkpoint(BigWriter(0), tmp_path, 20, {}, keep=3)


@pytest.mark.parametrize("zero", [0, 2])
def test_the_size_estimate_is_close_to_the_checkpoint_written(tmp_path, tiny_llama, zero):
    dataset = patterned_dataset()
    run = short_run(
        tmp_path / "run", "train.max_steps=2", f"train.deepspeed_config=configs/deepspeed/zero{zero}.json"
    )
    training_run = setup(run, base_model=tiny_llama, datasets=(dataset, dataset))
    try:
        train_steps(training_run)  # Adam's moments exist once it has stepped
        estimate = checkpoint.engine_state_bytes(training_run.engine)
        written = checkpoint.directory_bytes(save(training_run))
    finally:
        cleanup(training_run)
    assert 0.9 * written <= estimate <= 1.1 * written, (estimate, written)
