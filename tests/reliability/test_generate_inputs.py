"""``draftheads generate --prompts-file``: the format is read from the file's suffix (any case) or,
without a known suffix, from its content; what cannot be read is refused as one line naming
file:line, exit status 3 (bad input)."""

from __future__ import annotations

import json

import pytest

from draftheads.cli import main
from tests.reliability.generate_fixtures import run_generate, save_tiny_base


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


def prompts_read(capsys) -> list[str]:
    """The prompts ``generate`` decoded, from its ``--- prompt i: 'text'`` headers."""
    out = capsys.readouterr().out
    return [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("--- prompt ")]


def refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("draftheads generate: "), err
    return err.removeprefix("draftheads generate: ").strip()


@pytest.mark.parametrize(
    "name, text",
    [
        ("p.json", '{"prompt": "alpha"}\n{"prompt": "beta"}\n'),  # JSONL named .json
        ("p.JSONL", '{"prompt": "alpha"}\n\n{"prompt": "beta"}\n'),
        ("p.Json", json.dumps(["alpha", {"prompt": "beta"}], indent=2)),  # a JSON list
        ("p.ndjson", '"alpha"\n{"prompt": "beta"}\n'),
        ("prompts", '{"prompt": "alpha"}\n{"prompt": "beta"}\n'),  # no suffix: by content
        ("p.txt", "alpha\nbeta\n"),
    ],
)
def test_a_prompts_file_is_read_by_suffix_or_content(base_dir, tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert run_generate(main, base_dir, "--prompts-file", str(path)) == 0
    assert prompts_read(capsys) == ["'alpha'", "'beta'"]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n', ":2: not JSON ("),
        ("p.JSONL", '{"prompt": "a"}\n\n{"promt": "b"}\n', ":3: expected a string or an object with"),
        ("p.json", '[\n  "a",\n  {"prompt": ""}\n]\n', ":3: 'prompt' must be a non-empty string"),
        ("p.json", '[\n  "a",\n  7\n]\n', ":3: expected a string or an object with"),
        ("p.json", '{"prompts": ["a"]}\n', ":1: expected a string or an object with"),
        ("p.txt", "", ": no prompts in the file"),
    ],
)
def test_an_unreadable_prompts_file_is_refused_naming_file_and_line(
    base_dir, tmp_path, capsys, name, text, message
):
    path = tmp_path / name
    path.write_text(text)
    assert run_generate(main, base_dir, "--prompts-file", str(path)) == 3
    line = refusal(capsys)
    assert line.startswith(f"{path}:") and message in line, line


def test_a_prompts_file_that_is_not_utf8_is_refused(base_dir, tmp_path, capsys):
    path = tmp_path / "p.txt"
    path.write_bytes(b"alpha\n\xff\xfe beta\n")
    assert run_generate(main, base_dir, "--prompts-file", str(path)) == 3
    assert refusal(capsys).startswith(f"{path}:2: not UTF-8 text")
