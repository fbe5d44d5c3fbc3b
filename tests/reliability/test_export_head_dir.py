"""Which head a directory names: a training run's output directory stands for its ``head/``; a
directory with no config.json says what was expected; saved files get the umask's permissions."""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import build_head, load_head, resolve_base_model
from draftheads.heads.base import HeadFormatError, load_head_and_base, resolve_head_dir
from draftheads.heads.medusa import MedusaConfig


@pytest.fixture
def run_dir(tiny_llama, tmp_path):
    """What ``draftheads train`` leaves: the run config at the top, the final head under head/."""
    run = tmp_path / "run"
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    head.save_pretrained(run / "head")
    (run / "config.json").write_text(
        json.dumps({"model": {"base": "tiny-llama"}, "head": {"kind": "medusa"}})
    )
    (run / "metrics.jsonl").write_text("{}\n")
    return run


def test_a_run_directory_stands_for_its_head(run_dir, tiny_llama):
    assert resolve_head_dir(run_dir) == run_dir / "head"
    assert resolve_base_model(run_dir) == "tiny-llama"
    loaded = load_head(run_dir, base_model=tiny_llama)
    expected = load_head(run_dir / "head", base_model=tiny_llama)
    features = torch.randn(1, 3, 64)
    assert torch.equal(loaded.draft_logits(features), expected.draft_logits(features))
    head, model = load_head_and_base(run_dir, tiny_llama)
    assert model is tiny_llama and head.kind == "medusa"


def test_export_takes_a_run_directory(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "--heads", str(run_dir), "--out", str(out)]) == 0, capsys.readouterr().err
    exported = json.loads((out / "config.json").read_text())
    assert exported == json.loads((run_dir / "head" / "config.json").read_text())


def test_a_head_directory_with_a_head_subdirectory_is_still_itself(run_dir):
    # an engine checkpoint or head keeps its own weights at the top: it is not a run directory
    (run_dir / "head" / "head").mkdir()
    (run_dir / "head" / "head" / "config.json").write_text("{}")
    assert resolve_head_dir(run_dir / "head") == run_dir / "head"


def test_a_directory_without_config_says_what_it_expected(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(HeadFormatError) as caught:
        load_head(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"no config.json in head directory {tmp_path}: expected a head (config.json")
    assert "a training run's output directory holding one under head/" in message


def test_a_file_is_not_a_head_directory(run_dir):
    with pytest.raises(HeadFormatError, match="is a file; give the head directory"):
        load_head(run_dir / "head" / "model.safetensors")


def test_a_corrupt_weights_file_is_named(run_dir):
    weights = run_dir / "head" / "model.safetensors"
    weights.write_bytes(b"not safetensors at all")
    with pytest.raises(HeadFormatError, match=f"^{weights}: not a readable safetensors file"):
        load_head(run_dir)


def test_saved_weights_get_the_umask_mode(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=1, num_layers=1))
    previous = os.umask(0o022)
    try:
        directory = head.save_pretrained(tmp_path / "head")
    finally:
        os.umask(previous)
    assert (directory / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (directory / "config.json").stat().st_mode & 0o777 == 0o644
