"""Where `train` may write: a new or empty directory, or a run of its own. A directory holding
other files, or a saved head, is refused in one line naming what it holds, before any model loads,
and left as it was; a finished run is replaced only with --overwrite; runs from before the run
marker existed are still recognised (and resumed) by their files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import draftheads.commands.train
import draftheads.train.loop
from draftheads.cli import main
from draftheads.heads import build_head, load_head
from draftheads.train.loop import run_training
from draftheads.train.run_dir import MARKER_NAME, OutputDirRefusedError
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")

MEDUSA = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2_medusa_cpu.yaml")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


@pytest.fixture
def nothing_heavy(monkeypatch):
    """`train` with the data pipeline and the training loop replaced by recorders: a refusal must
    come before either runs."""
    calls = []
    monkeypatch.setattr(draftheads.commands.train, "print_data_summary", lambda run: calls.append("data"))
    monkeypatch.setattr(draftheads.train.loop, "run_training", lambda run, **options: calls.append("train"))
    return calls


@pytest.fixture
def finished(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    run_training(short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset))
    return tmp_path / "run", dataset


def test_a_directory_with_the_users_files_is_refused_before_anything_loads(tmp_path, capsys, nothing_heavy):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    before = _snapshot(mine)
    code = main(["train", "--config", MEDUSA, f"train.output_dir={mine}"])
    err = capsys.readouterr().err
    assert code != 0 and nothing_heavy == []
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "is not a draftheads training run" in err and "config.json" in err
    assert _snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["config.json"]


def test_the_training_loop_refuses_it_too_and_writes_nothing(tmp_path, tiny_llama):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    (mine / "notes.txt").write_text("keep me\n")
    before = _snapshot(mine)
    dataset = patterned_dataset()
    with pytest.raises(OutputDirRefusedError, match=r"it holds config.json, notes.txt"):
        run_training(short_run(mine), base_model=tiny_llama, datasets=(dataset, dataset))
    assert _snapshot(mine) == before


def test_a_head_directory_is_never_an_output_dir(tmp_path, tiny_llama):
    run = short_run(tmp_path / "unused")
    headcopy = tmp_path / "headcopy"
    build_head(tiny_llama, run.head, run.model.base).save_pretrained(headcopy)
    before = _snapshot(headcopy)
    dataset = patterned_dataset()
    same = short_run(headcopy, f"train.init_head={headcopy}")
    with pytest.raises(OutputDirRefusedError, match=r"holds a saved head \(config.json, model.safetensors\)"):
        run_training(same, base_model=tiny_llama, datasets=(dataset, dataset))
    assert _snapshot(headcopy) == before
    assert load_head(headcopy).kind == "medusa"  # still loads


def test_a_head_directory_is_refused_by_the_cli_in_one_line(tmp_path, tiny_llama, capsys, nothing_heavy):
    run = short_run(tmp_path / "unused")
    headcopy = tmp_path / "headcopy"
    build_head(tiny_llama, run.head, run.model.base).save_pretrained(headcopy)
    code = main(["train", "--config", MEDUSA, f"train.output_dir={headcopy}", f"train.init_head={headcopy}"])
    err = capsys.readouterr().err
    assert code != 0 and nothing_heavy == [] and len(err.strip().splitlines()) == 1
    assert "holds a saved head" in err


def test_a_finished_run_is_replaced_only_with_overwrite(finished, tiny_llama, capsys, nothing_heavy):
    output_dir, dataset = finished
    shutil.rmtree(output_dir / "checkpoints")
    before = _snapshot(output_dir)
    for resume in ("false", "true"):
        again = short_run(output_dir, f"train.resume={resume}")
        with pytest.raises(OutputDirRefusedError, match=r"holds a finished run .*--overwrite"):
            run_training(again, base_model=tiny_llama, datasets=(dataset, dataset))
    assert _snapshot(output_dir) == before
    code = main(["train", "--config", MEDUSA, f"train.output_dir={output_dir}"])
    err = capsys.readouterr().err
    assert code != 0 and nothing_heavy == [] and len(err.strip().splitlines()) == 1
    assert "--overwrite" in err
    summary = run_training(
        short_run(output_dir, "train.max_steps=2"),
        base_model=tiny_llama,
        datasets=(dataset, dataset),
        overwrite=True,
    )
    assert summary.steps == 2
    assert json.loads((output_dir / "head" / "config.json").read_text())["training"]["steps"] == 2


def test_a_new_run_writes_the_marker_and_an_old_run_without_it_still_resumes(finished, tiny_llama):
    output_dir, dataset = finished
    marker = json.loads((output_dir / MARKER_NAME).read_text())
    assert marker["format"] == "draftheads-run"
    (output_dir / MARKER_NAME).unlink()  # as a run from before the marker left it
    resumed = short_run(output_dir, "train.resume=true", "train.max_steps=6")
    assert run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset)).steps == 6


def test_an_empty_or_missing_directory_is_claimed(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    (tmp_path / "empty").mkdir()
    for name in ("empty", "new/nested"):
        summary = run_training(
            short_run(tmp_path / name, "train.max_steps=1"),
            base_model=tiny_llama,
            datasets=(dataset, dataset),
        )
        assert summary.steps == 1 and (tmp_path / name / MARKER_NAME).is_file()
