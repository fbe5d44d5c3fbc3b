"""``draftheads export --overwrite`` replaces a previous export and nothing else, atomically.

Each test reproduces a careless use: ``--out .``, ``--out <the run dir>``, ``--out`` a directory
that merely holds files, and a write that fails half way. Refusals delete nothing, and say so on
one line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import namedtuple

import pytest

from draftheads.cli import main
from draftheads.export import exporter
from draftheads.export.destination import MANIFEST_NAME
from draftheads.heads import build_head, load_head
from draftheads.heads.medusa import MedusaConfig


def snapshot(directory) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes): what a refusal must leave as it was."""
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


@pytest.fixture
def run_dir(tiny_llama, tmp_path):
    """A training run's output directory: run config, metrics, a checkpoint and the final head."""
    run = tmp_path / "runs" / "medusa"
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    head.save_pretrained(run / "head")
    (run / "config.json").write_text(
        json.dumps({"model": {"base": "tiny-llama"}, "head": {"kind": "medusa"}})
    )
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "trainer_state.json").write_text('{"step": 1}')
    return run


def export(heads, out, *extra) -> int:
    return main(["export", "--heads", str(heads), "--out", str(out), *extra])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("draftheads export: "), err
    return err


def test_overwrite_onto_the_current_directory_is_refused(run_dir, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "train.py").write_text("print('mine')\n")
    (work / "notes.md").write_text("mine\n")
    before = snapshot(work)
    monkeypatch.chdir(work)
    assert export(run_dir / "head", ".", "--overwrite") == 6
    err = one_line_error(capsys)
    assert "current directory" in err
    assert snapshot(work) == before


def test_overwrite_onto_a_parent_of_the_current_directory_is_refused(run_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "work" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "deeper")
    before = snapshot(tmp_path)
    assert export(run_dir / "head", tmp_path / "work", "--overwrite") == 6
    assert "current directory" in one_line_error(capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("which", ["run", "head", "runs"])
def test_overwrite_onto_the_head_or_a_directory_holding_it_is_refused(run_dir, which, capsys):
    out = {"run": run_dir, "head": run_dir / "head", "runs": run_dir.parent}[which]
    before = snapshot(run_dir)
    assert export(run_dir / "head", out, "--overwrite") == 6
    assert "holds the head being exported" in one_line_error(capsys)
    assert snapshot(run_dir) == before


def test_overwrite_onto_a_directory_that_is_not_an_export_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "table.csv").write_text("a,b\n")
    assert export(run_dir / "head", out, "--overwrite") == 6
    err = one_line_error(capsys)
    assert "not a draftheads export" in err and "table.csv" in err
    assert snapshot(out) == {"table.csv": b"a,b\n"}


def test_an_export_written_before_the_manifest_is_refused_with_what_to_do(run_dir, tmp_path, capsys):
    out = tmp_path / "old-export"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(run_dir / "head" / name, out / name)
    (out / "README.md").write_text("---\nlibrary_name: draftheads\n---\n")
    before = snapshot(out)
    assert export(run_dir / "head", out, "--overwrite") == 6
    err = one_line_error(capsys)
    assert f"delete it yourself (rm -r {out})" in err
    assert snapshot(out) == before


def test_an_export_holding_files_it_did_not_write_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert export(run_dir / "head", out) == 0
    (out / "my-notes.txt").write_text("keep me")
    before = snapshot(out)
    capsys.readouterr()
    assert export(run_dir / "head", out, "--overwrite") == 6
    assert "my-notes.txt" in one_line_error(capsys)
    assert snapshot(out) == before


def test_every_export_lists_its_files_in_a_manifest(run_dir, tmp_path):
    out = tmp_path / "export"
    assert export(run_dir / "head", out) == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["export_format"] == "draftheads"
    assert set(manifest["files"]) == {"config.json", "model.safetensors", "README.md"}
    assert {p.name for p in out.iterdir()} == set(manifest["files"]) | {MANIFEST_NAME}


def test_overwrite_replaces_a_previous_export(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert export(run_dir / "head", out) == 0
    first = snapshot(out)
    assert export(run_dir / "head", out, "--format", "medusa-vllm") == 6  # no --overwrite: refused
    assert "--overwrite" in one_line_error(capsys) and snapshot(out) == first
    assert export(run_dir / "head", out, "--format", "medusa-vllm", "--overwrite") == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MedusaModel"]
    assert json.loads((out / MANIFEST_NAME).read_text())["export_format"] == "medusa-vllm"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "runs"]  # no staging left over


def test_a_failure_mid_write_leaves_the_previous_export_intact(run_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    assert export(run_dir / "head", out) == 0
    before = snapshot(out)

    def write_then_fail(head, directory, format_name, options=None):
        (directory / "model.safetensors").write_bytes(b"half a tensor")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(exporter, "write_head", write_then_fail)
    capsys.readouterr()
    assert export(run_dir / "head", out, "--overwrite") == 5
    assert "No space left on device" in one_line_error(capsys)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "runs"]  # staging removed


def test_a_failed_first_export_leaves_nothing_a_rerun_refuses(run_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"

    def fail(head, directory, format_name, options=None):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(exporter, "write_head", fail)
    assert export(run_dir / "head", out) == 5
    assert not out.exists()
    monkeypatch.undo()
    assert export(run_dir / "head", out) == 0


def test_export_refuses_up_front_when_the_disk_is_too_full(run_dir, tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 4096, 4096))
    out = tmp_path / "exports" / "medusa"
    assert export(run_dir / "head", out) == 5
    err = one_line_error(capsys)
    assert f"not enough free space in {out} for the draftheads export" in err
    assert "4.0 KiB free" in err
    assert not (tmp_path / "exports").exists()


def test_the_space_estimate_covers_what_is_written(run_dir, tmp_path):
    out = tmp_path / "export"
    assert export(run_dir / "head", out) == 0
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    head = load_head(run_dir / "head")
    estimate = exporter.estimated_bytes(head, run_dir / "head", with_base_weights=False, joint=False)
    assert written <= estimate < written + exporter.SPACE_MARGIN_BYTES  # tensors + margin


def test_out_naming_a_file_is_refused(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    out.write_text("a file")
    assert export(run_dir / "head", out, "--overwrite") == 6
    assert "is not a directory" in one_line_error(capsys)
    assert out.read_text() == "a file"


def test_exported_files_and_directory_get_normal_permissions(run_dir, tmp_path):
    previous = os.umask(0o022)
    try:
        out = tmp_path / "export"
        assert export(run_dir / "head", out) == 0
    finally:
        os.umask(previous)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {
        name: 0o644 for name in ("config.json", "model.safetensors", "README.md", MANIFEST_NAME)
    }
