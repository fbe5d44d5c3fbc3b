"""Resuming runs no code from a checkpoint: a pickle that names anything beyond tensors and
DeepSpeed's own state (here ``os.makedirs``, which would leave a directory behind) is refused with
one line naming the file, even when the manifest was rewritten to match it; checkpoints written
before RNG states were stored as tensors still resume."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy
import pytest
import torch

from draftheads.heads.base import HeadFormatError
from draftheads.train import checkpoint
from draftheads.train.loop import run_training
from tests.reliability.train_fixtures import patterned_dataset, short_run
from tests.train.test_checkpoint import FakeEngine

pytestmark = pytest.mark.usefixtures("single_thread")
ZERO2 = {"zero_optimization": {"stage": 2}}  # its optimizer state pickles DeepSpeed's classes


class LeavesADirectory:
    """Unpickling it calls ``os.makedirs(path)``: the side effect a crafted checkpoint would have."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


class SwappedAfterTheCheck(FakeEngine):
    """Finds a crafted file in place of its own (swapped in after draftheads checked the files) and
    reads it the way DeepSpeed's TorchCheckpointEngine does: ``torch.load(weights_only=False)``."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def load_checkpoint(self, directory, tag, **kwargs):
        path = Path(directory) / tag / "model.pt"
        torch.save({"crafted": LeavesADirectory(self.marker)}, path)
        torch.load(path, weights_only=False)
        return super().load_checkpoint(directory, tag, **kwargs)


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    """A finished ZeRO-2 run with checkpoints at steps 2 and 4 (copied by each test)."""
    from tests.conftest import make_tiny_llama

    root = tmp_path_factory.mktemp("zero2")
    config = root / "zero2.json"
    config.write_text(json.dumps(ZERO2))
    dataset = patterned_dataset()
    run = short_run(root / "run", f"train.deepspeed_config={config}")
    run_training(run, base_model=make_tiny_llama(), datasets=(dataset, dataset))
    return root / "run", config


def _copy(zero2_run, tmp_path):
    source, config = zero2_run
    shutil.copytree(source, tmp_path / "run")
    return tmp_path / "run", config


def _add_payload(step_dir, path, marker):
    """Re-save the pickle at ``path`` with a crafted entry, and ``step_dir``'s manifest to match."""
    state = torch.load(path, weights_only=False)  # our own file, written by the fixture
    state["crafted"] = LeavesADirectory(marker)
    torch.save(state, path)
    checkpoint.write_manifest(step_dir)


def _resume(output_dir, config, tiny_llama):
    dataset = patterned_dataset()
    resumed = short_run(
        output_dir, "train.resume=true", "train.max_steps=6", f"train.deepspeed_config={config}"
    )
    return run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset))


def test_a_zero2_checkpoint_resumes_through_the_allow_list(zero2_run, tmp_path, tiny_llama):
    output_dir, config = _copy(zero2_run, tmp_path)
    assert _resume(output_dir, config, tiny_llama).steps == 6


@pytest.mark.parametrize("target", ["engine", "rng"])
def test_a_crafted_checkpoint_file_is_refused_and_never_run(zero2_run, tmp_path, tiny_llama, target):
    output_dir, config = _copy(zero2_run, tmp_path)
    step_dir = checkpoint.latest_checkpoint(output_dir)
    if target == "engine":
        crafted = next((step_dir / checkpoint.ENGINE_TAG).glob("*optim_states.pt"))
    else:
        crafted = step_dir / "rng_state_0.pt"
    marker = tmp_path / "ran-code"
    _add_payload(step_dir, crafted, marker)
    assert checkpoint.verify_checkpoint(step_dir)  # the manifest matches: only the content is wrong
    with pytest.raises(HeadFormatError, match=rf"{crafted}: not loaded: .*it names os.makedirs"):
        _resume(output_dir, config, tiny_llama)
    assert not marker.exists()


def test_a_file_deepspeed_reads_after_the_check_still_runs_nothing(tmp_path):
    path = checkpoint.save_checkpoint(FakeEngine(), tmp_path, 7, {}, keep=1)
    marker = tmp_path / "ran-code"
    with pytest.raises(HeadFormatError, match=rf"{path / 'engine'}: not loaded: .*it names os.makedirs"):
        checkpoint.load_checkpoint(SwappedAfterTheCheck(marker), path)
    assert not marker.exists()


def test_rng_states_are_saved_as_tensors_and_plain_values(tmp_path):
    path = checkpoint.save_checkpoint(FakeEngine(), tmp_path, 7, {}, keep=1)
    state = torch.load(path / "rng_state_0.pt", weights_only=True)  # no class beyond torch's own
    assert set(state) >= {"torch", "python", "numpy"}


def test_an_rng_state_with_numpy_arrays_from_older_checkpoints_still_restores(tmp_path):
    path = checkpoint.save_checkpoint(FakeEngine(), tmp_path, 7, {}, keep=1)
    numpy.random.seed(3)
    random.seed(3)
    older = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy.random.get_state()}
    torch.save(older, path / "rng_state_0.pt")  # as draftheads wrote it before
    expected = (numpy.random.rand(), random.random())
    numpy.random.seed(99)
    random.seed(99)
    checkpoint.load_checkpoint(FakeEngine(), path)
    assert (numpy.random.rand(), random.random()) == expected
