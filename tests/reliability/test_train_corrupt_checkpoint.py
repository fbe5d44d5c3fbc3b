"""Resuming when the newest checkpoint is damaged: fall back to the newest intact one with a
warning naming the broken one and why; none intact is a clear error; checkpoints written before
manifests load unverified, with a warning."""

from __future__ import annotations

import json

import pytest

from draftheads.settings import ConfigError
from draftheads.train import checkpoint
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")


def _cut_short(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _engine_files(step_dir):
    return sorted(path for path in (step_dir / checkpoint.ENGINE_TAG).rglob("*") if path.is_file())


@pytest.fixture
def trained(tmp_path, tiny_llama):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    dataset = patterned_dataset()
    run_training(short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset))
    return tmp_path / "run", dataset


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(trained, tiny_llama, capsys):
    output_dir, dataset = trained
    broken = output_dir / "checkpoints" / "step-00000004"
    _cut_short(_engine_files(broken)[0])  # a copy cut short
    resumed = short_run(output_dir, "train.resume=true", "train.max_steps=6")
    with pytest.warns(
        UserWarning, match=rf"checkpoint {broken} is broken \(.* has \d+ bytes, the manifest says"
    ):
        summary = run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset))
    assert summary.steps == 6
    assert f"resumed from {output_dir / 'checkpoints' / 'step-00000002'} at step 2" in capsys.readouterr().out
    assert [record["step"] for record in read_metrics(output_dir) if "loss" in record] == [1, 2, 3, 4, 5, 6]
    names = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    assert names == ["corrupt-step-00000004", "step-00000002", "step-00000004", "step-00000006"]
    assert all(checkpoint.verify_checkpoint(path) for path in checkpoint.list_checkpoints(output_dir))


def test_no_intact_checkpoint_is_a_clear_error(trained, tiny_llama):
    output_dir, dataset = trained
    for step_dir in checkpoint.list_checkpoints(output_dir):
        (step_dir / checkpoint.STATE_NAME).write_text("{}")
    resumed = short_run(output_dir, "train.resume=true", "train.max_steps=6")
    with pytest.raises(
        ConfigError, match=r"no intact checkpoint to resume from .*step-00000002: .*trainer_state"
    ):
        run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset))


def test_checkpoints_from_before_manifests_load_unverified(trained, tiny_llama):
    output_dir, dataset = trained
    for step_dir in checkpoint.list_checkpoints(output_dir):  # as an older draftheads wrote them
        (step_dir / checkpoint.MANIFEST_NAME).unlink()
        state = json.loads((step_dir / checkpoint.STATE_NAME).read_text())
        del state["run_config"], state["data_history"]
        (step_dir / checkpoint.STATE_NAME).write_text(json.dumps(state))
    config = json.loads((output_dir / "config.json").read_text())  # ... without a newer setting
    del config["train"]["loss_token_fraction"]
    (output_dir / "config.json").write_text(json.dumps(config))
    resumed = short_run(output_dir, "train.resume=true", "train.max_steps=6")
    with (
        pytest.warns(UserWarning, match=r"step-00000004 has no manifest.json .* cannot be verified"),
        pytest.warns(UserWarning, match=r"does not record train.loss_token_fraction"),
    ):
        summary = run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset))
    assert summary.steps == 6 and len(summary.data_history) == 1
