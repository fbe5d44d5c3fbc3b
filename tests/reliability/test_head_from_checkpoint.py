"""A head is recoverable from a training checkpoint: ``<run>/checkpoints/step-N`` loads as a head
directory (export, generate --heads, train.init_head), giving the weights the run had at step N;
a run without head/ names its newest checkpoint; checkpoints that cannot stand for a head (written
before they carried config.json, or under ZeRO-3) say how to get it: resume for zero more steps."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import load_head
from draftheads.heads.base import HeadFormatError
from draftheads.train import checkpoint
from draftheads.train.loop import run_training
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step Medusa run: checkpoints at steps 2 and 4, its head saved at step 4."""
    from tests.conftest import make_tiny_llama

    output_dir = tmp_path_factory.mktemp("recover") / "run"
    dataset = patterned_dataset()
    run_training(short_run(output_dir), base_model=make_tiny_llama(), datasets=(dataset, dataset))
    return output_dir


@pytest.fixture
def run_dir(finished_run, tmp_path):
    shutil.copytree(finished_run, tmp_path / "run")
    return tmp_path / "run"


def _same_weights(first, second):
    first, second = first.state_dict(), second.state_dict()
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_export_takes_a_checkpoint_and_gives_the_heads_weights_at_that_step(run_dir, tmp_path, capsys):
    step_dir = checkpoint.latest_checkpoint(run_dir)  # step 4, where the final head was saved too
    out = tmp_path / "out"
    assert main(["export", "--heads", str(step_dir), "--out", str(out)]) == 0, capsys.readouterr().err
    assert _same_weights(load_head(out), load_head(run_dir / "head"))
    card = (out / "README.md").read_text()
    assert "| training steps | 4 |" in card


def test_an_earlier_checkpoint_drafts_as_a_head(run_dir, tiny_llama):
    step_dir = checkpoint.list_checkpoints(run_dir)[0]  # step 2
    head = load_head(step_dir, base_model=tiny_llama)
    assert head.kind == "medusa" and not _same_weights(head, load_head(run_dir / "head"))
    assert head.draft_logits(torch.randn(1, 3, 64)).shape[:3] == (1, 3, 2)


def test_a_run_that_did_not_finish_names_its_newest_checkpoint(run_dir):
    shutil.rmtree(run_dir / "head")
    newest = checkpoint.latest_checkpoint(run_dir)
    with pytest.raises(HeadFormatError, match=rf"without head/ .*give --heads {newest}$"):
        load_head(run_dir)


def test_an_older_checkpoint_without_config_says_to_resume_for_zero_steps(run_dir, tiny_llama):
    step_dir = checkpoint.latest_checkpoint(run_dir)
    (step_dir / "config.json").unlink()
    checkpoint.write_manifest(step_dir)
    shutil.rmtree(run_dir / "head")
    with pytest.raises(HeadFormatError, match=r"resume the run for zero more steps .*max_steps .* 4\)"):
        load_head(step_dir)
    dataset = patterned_dataset()  # ... and doing so writes the head
    resumed = short_run(run_dir, "train.resume=true", "train.max_steps=4")
    assert run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset)).steps == 4
    assert json.loads((run_dir / "head" / "config.json").read_text())["training"]["steps"] == 4


def test_a_zero3_checkpoint_says_to_resume_for_zero_steps(run_dir):
    step_dir = checkpoint.latest_checkpoint(run_dir)
    engine = step_dir / checkpoint.ENGINE_TAG
    (engine / "mp_rank_00_model_states.pt").rename(engine / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    with pytest.raises(HeadFormatError, match=r"ZeRO-3 .*resume the run for zero more steps"):
        load_head(step_dir)


def test_a_damaged_checkpoint_is_refused_as_a_head_naming_the_file(run_dir, tmp_path, capsys):
    step_dir = checkpoint.latest_checkpoint(run_dir)
    weights = step_dir / checkpoint.ENGINE_TAG / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2  # inside the tensors' bytes: torch still reads the file
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    weights.write_bytes(data)
    out = tmp_path / "out"
    assert main(["export", "--heads", str(step_dir), "--out", str(out)]) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{weights} does not match its sha256" in err
    assert not out.exists()
    with pytest.raises(HeadFormatError, match="mp_rank_00_model_states.pt does not match its sha256"):
        load_head(step_dir)  # generate --heads and train.init_head read it this way too
