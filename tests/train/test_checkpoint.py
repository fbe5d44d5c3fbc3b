import json
import random
from pathlib import Path

import pytest
import torch

from draftheads.train import checkpoint


class FakeEngine:
    """Writes like DeepSpeed (files under dir/tag); optionally fails half-way."""

    def __init__(self, fail=False):
        self.fail = fail
        self.loaded = None
        self.module = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def save_checkpoint(self, directory, tag, save_latest=True):
        path = Path(directory) / tag
        path.mkdir(parents=True)
        torch.save(self.module.state_dict(), path / "model.pt")
        if self.fail:
            raise OSError("disk full")

    def load_checkpoint(self, directory, tag, **kwargs):
        self.loaded = (directory, tag)
        return directory, {}


def test_checkpoints_are_renamed_into_place_and_pruned(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save_checkpoint(
            FakeEngine(), tmp_path, step, {"data_position": {"epoch": 0, "index": step}}, keep=2
        )
    names = [path.name for path in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step-00000020", "step-00000030"]
    assert checkpoint.read_trainer_state(checkpoint.latest_checkpoint(tmp_path))["step"] == 30
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_failed_save_leaves_no_partial_directory(tmp_path):
    checkpoint.save_checkpoint(FakeEngine(), tmp_path, 10, {}, keep=3)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(FakeEngine(fail=True), tmp_path, 20, {}, keep=3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000010"]
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-00000010"


def test_incomplete_and_temporary_directories_are_ignored(tmp_path):
    checkpoint.save_checkpoint(FakeEngine(), tmp_path, 10, {}, keep=3)
    (tmp_path / "checkpoints" / "step-00000050").mkdir()  # killed before trainer_state.json
    (tmp_path / "checkpoints" / ".tmp-step-00000060").mkdir()  # killed mid-write
    assert checkpoint.latest_checkpoint(tmp_path).name == "step-00000010"
    checkpoint.save_checkpoint(FakeEngine(), tmp_path, 20, {}, keep=3)
    assert not (tmp_path / "checkpoints" / ".tmp-step-00000060").exists()


def test_load_restores_rng_and_state(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    path = checkpoint.save_checkpoint(FakeEngine(), tmp_path, 7, {"tokens": 123}, keep=1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    engine = FakeEngine()
    state = checkpoint.load_checkpoint(engine, path)
    assert state["tokens"] == 123 and state["step"] == 7
    assert engine.loaded == (str(path), checkpoint.ENGINE_TAG)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpoint.load_checkpoint(engine, tmp_path / "checkpoints" / "missing")


def test_every_file_is_in_the_manifest_and_damage_is_found(tmp_path):
    path = checkpoint.save_checkpoint(FakeEngine(), tmp_path, 10, {"tokens": 1}, keep=3)
    manifest = json.loads((path / checkpoint.MANIFEST_NAME).read_text())["files"]
    assert sorted(manifest) == ["engine/model.pt", "rng_state_0.pt", "trainer_state.json"]
    assert checkpoint.verify_checkpoint(path) is True
    model = path / "engine" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    model.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"model.pt does not match its sha256"):
        checkpoint.verify_checkpoint(path)
    model.write_bytes(bytes(data[:10]))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"model.pt has 10 bytes, the manifest says"):
        checkpoint.verify_checkpoint(path)
    model.unlink()
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"model.pt is missing"):
        checkpoint.verify_checkpoint(path)
    (path / checkpoint.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"manifest.json cannot be read"):
        checkpoint.verify_checkpoint(path)


def test_resume_point_skips_broken_checkpoints_and_takes_unverifiable_old_ones(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save_checkpoint(FakeEngine(), tmp_path, step, {}, keep=3)
    root = tmp_path / "checkpoints"
    (root / "step-00000010" / checkpoint.MANIFEST_NAME).unlink()  # as written before manifests
    (root / "step-00000030" / "rng_state_0.pt").write_bytes(b"cut short")
    point = checkpoint.find_resume_checkpoint(tmp_path)
    assert point.path == root / "step-00000020" and point.verified
    assert [(path.name, "rng_state_0.pt has 9 bytes" in why) for path, why in point.skipped] == [
        ("step-00000030", True)
    ]
    (root / "step-00000020" / checkpoint.STATE_NAME).write_text("{}")
    point = checkpoint.find_resume_checkpoint(tmp_path)
    assert point.path == root / "step-00000010" and not point.verified
    assert [path.name for path, _ in point.skipped] == ["step-00000030", "step-00000020"]
    (root / "step-00000010" / checkpoint.STATE_NAME).write_text("{cut")
    with pytest.raises(checkpoint.CorruptCheckpointError, match="no intact checkpoint to resume from"):
        checkpoint.find_resume_checkpoint(tmp_path)
    aside = checkpoint.set_aside(root / "step-00000030")
    assert aside.name == "corrupt-step-00000030"
    assert [path.name for path in checkpoint.list_checkpoints(tmp_path)] == ["step-00000010", "step-00000020"]
    assert checkpoint.find_resume_checkpoint(tmp_path / "elsewhere").path is None
