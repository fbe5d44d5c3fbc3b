"""Every ``draftheads`` command ends a user error as one line on stderr, ``draftheads <command>:
<message>``, with the exit status of its kind (docs/cli-exit-codes.md) and no traceback;
``--debug`` (or DRAFTHEADS_DEBUG=1) shows the traceback; a bug still shows its traceback, with a
line asking to report it, and exits 70."""

from __future__ import annotations

import errno
import importlib
import os
import re
from pathlib import Path

import pytest

from draftheads import cli
from draftheads.cli import main
from draftheads.export import exporter, write_head
from draftheads.export.destination import DestinationError
from draftheads.heads import build_head
from draftheads.heads.base import HeadMismatchError
from draftheads.heads.eagle import EagleConfig
from draftheads.heads.medusa import MedusaConfig
from draftheads.settings import ConfigError
from draftheads.storage import InsufficientSpaceError


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
    assert main(["export", "--heads", str(missing), "--out", str(tmp_path / "out")]) == 4
    assert one_line(capsys, "export") == f"head directory {missing} does not exist"


def test_a_corrupt_safetensors_file_is_named(head_dir, tmp_path, capsys):
    (head_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 4
    message = one_line(capsys, "export")
    assert message.startswith(f"{head_dir / 'model.safetensors'}: not a readable safetensors file (")
    assert not (tmp_path / "out").exists()


def test_a_truncated_safetensors_file_is_named(head_dir, tmp_path, capsys):
    weights = head_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 4
    assert one_line(capsys, "export").startswith(f"{weights}: not a readable safetensors file (")


def test_a_damaged_torch_checkpoint_is_named(tiny_llama, tmp_path, capsys):
    head = build_head(tiny_llama, EagleConfig(), base_name="tiny-llama")
    write_head(head, tmp_path / "eagle", "eagle-sglang")
    (tmp_path / "eagle" / "model.safetensors").unlink()
    weights = tmp_path / "eagle" / "pytorch_model.bin"
    weights.write_bytes(b"PK\x03\x04 not a zip archive")
    assert main(["export", "--heads", str(tmp_path / "eagle"), "--out", str(tmp_path / "out")]) == 4
    assert one_line(capsys, "export").startswith(f"{weights}: not a readable torch checkpoint (")


def test_a_missing_config_file(tmp_path, capsys):
    missing = tmp_path / "missing.yaml"
    assert main(["data", "inspect", "--config", str(missing)]) == 3
    assert str(missing) in one_line(capsys, "data")


def test_a_bad_config_names_the_field(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  limt: 10\n")
    assert main(["data", "inspect", "--config", str(config)]) == 3
    assert "limt" in one_line(capsys, "data")


def test_permission_denied_says_what_to_do(head_dir, tmp_path, monkeypatch, capsys):
    def refuse(head, directory, format_name, options=None):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(directory / "config.json"))

    monkeypatch.setattr(exporter, "write_head", refuse)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 5
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
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 70
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


# ---- one exit status per kind of error -----------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli-exit-codes.md"


def documented_codes() -> dict[int, set[str]]:
    """docs/cli-exit-codes.md's table: code -> the backticked names in its errors column."""
    table = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            table[int(cells[0])] = set(re.findall(r"`(\w+)`", cells[2]))
    return table


def test_the_documented_exit_codes_are_the_codes_the_cli_uses():
    documented = documented_codes()
    for kind in cli.ERROR_KINDS:
        names = {name for _, name in kind.classes} | set(kind.errnos)
        assert documented.pop(kind.status) == names, f"exit code {kind.status}"
    assert documented == {
        cli.EXIT_OK: set(),
        cli.EXIT_USAGE: set(),
        cli.EXIT_BUG: set(),
        cli.EXIT_INTERRUPTED: {"KeyboardInterrupt"},
    }
    for kind in cli.ERROR_KINDS:  # every named class exists where the mapping says
        for module, name in kind.classes:
            assert isinstance(getattr(importlib.import_module(module), name), type), (module, name)


def test_an_error_takes_the_status_of_its_base_class():
    class LockedAndBad(ConfigError, FileExistsError):  # as a refusal may be both
        pass

    class WorseConfig(ConfigError):
        pass

    assert cli.exit_status(LockedAndBad("locked")) == cli.EXIT_REFUSED
    assert cli.exit_status(DestinationError("exists")) == cli.EXIT_REFUSED
    assert cli.exit_status(WorseConfig("bad")) == cli.EXIT_BAD_INPUT
    assert cli.exit_status(HeadMismatchError("vocab")) == cli.EXIT_HEAD
    assert cli.exit_status(InsufficientSpaceError(errno.ENOSPC, "no space")) == cli.EXIT_ENVIRONMENT
    assert cli.exit_status(OSError(errno.EROFS, "read-only")) == cli.EXIT_ENVIRONMENT
    assert cli.exit_status(OSError(errno.EIO, "I/O error")) == cli.EXIT_OTHER
    assert cli.exit_status(KeyError("x")) == cli.EXIT_BUG


def test_an_existing_export_is_refused_with_6(head_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["export", "--heads", str(head_dir), "--out", str(out)]) == cli.EXIT_REFUSED
    assert str(out) in one_line(capsys, "export")


def test_commands_leave_the_status_to_the_cli(head_dir, tmp_path, capsys):
    """A head error is 4 and a config error 3 in every command, not a status each command picks."""
    (head_dir / "config.json").write_text("{}")
    assert main(["tune-tree", "--heads", str(head_dir), "--dtype", "float32"]) == cli.EXIT_HEAD
    assert "config.json" in one_line(capsys, "tune-tree")
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  limt: 10\n")
    assert main(["cache-features", "--config", str(config)]) == cli.EXIT_BAD_INPUT
    assert "limt" in one_line(capsys, "cache-features")


def test_an_unusable_device_is_an_environment_error(head_dir, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["tune-tree", "--heads", str(head_dir), "--device", "cuda"]) == cli.EXIT_ENVIRONMENT
    assert one_line(capsys, "tune-tree").startswith("device 'cuda' is not available")
