"""Shipped heads by short name: ``draftheads.shipped`` is the one place that knows where they live;
every command resolves a head through it, and no other code names their directories."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftheads.cli import main
from draftheads.heads.base import HeadFormatError, read_head_config
from draftheads.shipped import CHECKOUT, SHIPPED_HEADS, resolve_head_dir

ROOT = Path(__file__).resolve().parents[1]
# Where code may live that could name a head directory: everything but docs/.
CODE = ("draftheads", "engines", "tests", "configs", "scripts", "Makefile", ".ci")
# the folder of the shipped heads, spelled as one path or built from its parts
TEXT_SUFFIXES = ("", ".py", ".yaml", ".json", ".sh", ".txt")
HEADS_FOLDER = re.compile(r"""results['"]?\s*[/,]\s*['"]?heads\b""")


# the base a shipped head's name ends with -> the base alias its config records
BASES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def test_every_shipped_head_is_there_with_its_model_card():
    assert CHECKOUT == ROOT
    for name in SHIPPED_HEADS:
        directory = resolve_head_dir(name)
        saved = json.loads((directory / "config.json").read_text())
        kind, base = name.split("-")
        assert saved["head_kind"] == kind
        assert saved["base_model"]["name_or_path"] == BASES[base]
        assert (directory / "model.safetensors").is_file() and (directory / "README.md").is_file()


def test_every_loader_takes_a_short_name():
    config_path, saved = read_head_config("dflash-smollm2")  # load_head, bench, export, generate, tune-tree
    assert config_path == ROOT / SHIPPED_HEADS["dflash-smollm2"] / "config.json"
    assert saved["head_kind"] == "dflash"


def test_an_existing_path_wins_over_a_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eagle3-smollm2").mkdir()
    assert resolve_head_dir("eagle3-smollm2") == Path("eagle3-smollm2")


def test_an_unknown_name_lists_the_shipped_heads(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HeadFormatError, match="shipped heads: eagle3-smollm2, dflash-smollm2, eagle3-gemma3"):
        resolve_head_dir("eagle3-smolm2")
    assert main(["export", "--heads", "eagle3-smolm2", "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eagle3-smollm2, dflash-smollm2" in err, err
    with pytest.raises(HeadFormatError, match="^head directory missing/head does not exist$"):
        resolve_head_dir("missing/head")  # spelled as a path: no list of names


def names_heads_folder(path: Path) -> bool:
    if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
        return False
    return bool(HEADS_FOLDER.search(path.read_text("utf-8", "ignore")))


def test_only_the_shipped_module_names_the_head_directories():
    named = []
    for place in CODE:
        files = [ROOT / place] if (ROOT / place).is_file() else sorted((ROOT / place).rglob("*"))
        named += [str(path.relative_to(ROOT)) for path in files if names_heads_folder(path)]
    assert named == ["draftheads/shipped.py"]
