"""A truncated or foreign ``.gguf`` given as the base is one line naming the file (exit 5), not a
traceback from deep inside the GGUF reader."""

from __future__ import annotations

import pytest

from draftheads.base_model import locate_embedded
from draftheads.cli import main
from tests.reliability.test_cli_errors import one_line


@pytest.mark.parametrize("damage", ["truncated", "text"])
def test_a_damaged_gguf_base_is_named_in_one_line(tmp_path, capsys, monkeypatch, damage):
    monkeypatch.setenv("DRAFTHEADS_CACHE", str(tmp_path / "cache"))  # no converted copy to fall back on
    gguf = tmp_path / "model.gguf"
    if damage == "truncated":
        with locate_embedded("smollm2-135m-instruct").open("rb") as source:
            gguf.write_bytes(source.read(2_000_000))  # the header and part of the tensors
    else:
        gguf.write_text("not a gguf file\n")
    code = main(["generate", "--base", str(gguf), "--prompt", "hi", "--max-new-tokens", "2"])
    message = one_line(capsys, "generate")
    assert code == 5
    assert message.startswith(f"{gguf}: not a readable GGUF model")
