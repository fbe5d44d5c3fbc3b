"""``fit-confidence`` on a full disk: too little free space is refused before the base loads, and a
disk that fills while the confidence head is written ends as one line naming the file, with the
environment's status (5), leaving no partial file in the head."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import MtpConfig, build_head
from draftheads.infer.confidence import CONFIDENCE_CONFIG, CONFIDENCE_FILE
from tests.reliability.generate_fixtures import save_tiny_base
from tests.reliability.test_cli_errors import one_line
from tests.reliability.test_export_free_space import fake_disk

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture
def head_dir(base_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    return build_head(base, MtpConfig(num_modules=2), str(base_dir)).save_pretrained(tmp_path / "head")


def fit_confidence(head_dir, tmp_path) -> int:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"Say {i} twice."]}) + "\n" for i in range(4)))
    options = ["--skip", "0", "--prompts", "4", "--max-new-tokens", "24", "--steps", "5", "--pack", "off"]
    return main(["fit-confidence", "--heads", str(head_dir), "--data", str(prompts), *options])


def last_line(capsys, command: str) -> str:
    """The error line ending stderr, after the progress bars of loading and decoding."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"draftheads {command}: "), err
    return last.removeprefix(f"draftheads {command}: ")


def test_too_little_free_space_is_refused_before_the_base_loads(head_dir, tmp_path, monkeypatch, capsys):
    import draftheads.base_model

    def no_loading(*args, **kwargs):
        raise AssertionError("the base model was loaded before the free space was checked")

    monkeypatch.setattr(draftheads.base_model, "load_base", no_loading)
    fake_disk(monkeypatch, free=100)
    before = sorted(head_dir.iterdir())
    assert fit_confidence(head_dir, tmp_path) == 5
    message = one_line(capsys, "fit-confidence")
    assert message.startswith(f"not enough free space in {head_dir} for the confidence head"), message
    assert f"{head_dir / CONFIDENCE_FILE}" in message and "100 B free" in message
    assert sorted(head_dir.iterdir()) == before


def test_a_disk_that_fills_while_writing_is_exit_5_naming_the_file(head_dir, tmp_path, monkeypatch, capsys):
    """The temporary file the confidence weights go to is a link to /dev/full, where every write
    fails with ENOSPC, as on a full disk (safetensors' ``save_file`` reports no error there: the
    weights would be lost without a word)."""
    make_temporary = tempfile.mkstemp

    def full_disk(*args, prefix=None, dir=None, **kwargs):
        handle, name = make_temporary(*args, prefix=prefix, dir=dir, **kwargs)
        if prefix and prefix.startswith(".confidence") and kwargs.get("suffix") == ".safetensors":
            os.close(handle)
            os.unlink(name)
            os.symlink("/dev/full", name)
            handle = os.open(name, os.O_WRONLY)
        return handle, name

    monkeypatch.setattr(tempfile, "mkstemp", full_disk)
    before = sorted(head_dir.iterdir())
    assert fit_confidence(head_dir, tmp_path) == 5
    message = last_line(capsys, "fit-confidence")
    assert message.startswith(f"{head_dir / CONFIDENCE_FILE}: No space left on device"), message
    assert sorted(head_dir.iterdir()) == before  # no partial file, no temporary file
    assert not (head_dir / CONFIDENCE_CONFIG).exists()
