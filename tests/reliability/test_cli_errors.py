"""Every ``draftheads`` command ends a user error as one line on stderr, ``draftheads <command>:
<message>``, with exit status 1 and no traceback; ``--debug`` (or DRAFTHEADS_DEBUG=1) shows the
traceback; a bug still shows its traceback, with a line asking to report it."""

from __future__ import annotations

import errno
import os

import pytest

from draftheads.cli import main
from draftheads.export import exporter, write_head
from draftheads.heads import build_head
from draftheads.heads.eagle import EagleConfig
from draftheads.heads.medusa import MedusaConfig
from draftheads.settings import ConfigError


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"draftheads {command}: "), err
    return err.removeprefix(f"draftheads {command}: ").strip()


def test_a_missing_head_directory(tmp_path, capsys):
    missing = tmp_path / "no-such-head"
    assert main(["export", "--heads", str(missing), "--out", str(tmp_path / "out")]) == 1
    assert one_line(capsys, "export") == f"head directory {missing} does not exist"


def test_a_corrupt_safetensors_file_is_named(head_dir, tmp_path, capsys):
    (head_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 1
    message = one_line(capsys, "export")
    assert message.startswith(f"{head_dir / 'model.safetensors'}: not a readable safetensors file (")
    assert not (tmp_path / "out").exists()


def test_a_truncated_safetensors_file_is_named(head_dir, tmp_path, capsys):
    weights = head_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 1
    assert one_line(capsys, "export").startswith(f"{weights}: not a readable safetensors file (")


def test_a_damaged_torch_checkpoint_is_named(tiny_llama, tmp_path, capsys):
    head = build_head(tiny_llama, EagleConfig(), base_name="tiny-llama")
    write_head(head, tmp_path / "eagle", "eagle-sglang")
    (tmp_path / "eagle" / "model.safetensors").unlink()
    weights = tmp_path / "eagle" / "pytorch_model.bin"
    weights.write_bytes(b"PK\x03\x04 not a zip archive")
    assert main(["export", "--heads", str(tmp_path / "eagle"), "--out", str(tmp_path / "out")]) == 1
    assert one_line(capsys, "export").startswith(f"{weights}: not a readable torch checkpoint (")


def test_a_missing_config_file(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main(["data", "inspect", "--config", str(missing)]) == 1
    assert str(missing) in one_line(capsys, "data")


def test_a_bad_config_names_the_field(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  limt: 10\n")
    assert main(["data", "inspect", "--config", str(config)]) == 1
    assert "limt" in one_line(capsys, "data")


def test_permission_denied_says_what_to_do(head_dir, tmp_path, monkeypatch, capsys):
    def refuse(head, directory, format_name, options=None):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory / "config.json"))

    monkeypatch.setattr(exporter, "write_head", refuse)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 1
    message = one_line(capsys, "export")
    assert message.endswith("config.json: Permission denied; check the permissions, or write elsewhere")


def test_debug_shows_the_traceback(tmp_path, monkeypatch):
    arguments = ["export", "--heads", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="does not exist"):
        main(["--debug", *arguments])
    monkeypatch.setenv("DRAFTHEADS_DEBUG", "1")
    with pytest.raises(ValueError, match="does not exist"):
        main(arguments)


def test_debug_shows_a_config_error_too(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  limt: 10\n")
    with pytest.raises(ConfigError, match="limt"):
        main(["--debug", "data", "inspect", "--config", str(config)])


def test_a_bug_shows_its_traceback_and_asks_for_a_report(head_dir, tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("head_config")

    monkeypatch.setattr("draftheads.commands.export.export_head", broken)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "KeyError: 'head_config'" in err
    assert err.splitlines()[-1] == (
        "draftheads export: internal error (KeyError); this is a bug in draftheads, "
        "please report it with the command line and the traceback above"
    )


def test_an_interrupt_is_one_line(head_dir, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("draftheads.commands.export.export_head", interrupted)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 130
    assert one_line(capsys, "export") == "interrupted"


def test_the_debug_flag_is_listed_in_the_help(capsys):
    assert main(["--help"]) == 0
    assert "--debug" in capsys.readouterr().out
