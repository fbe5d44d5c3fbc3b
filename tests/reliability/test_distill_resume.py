"""``draftheads distill --out`` continues a file only under the settings that made it: they are
recorded beside it, and a run whose base, source (or its content), sampling or length settings differ
is refused in one line naming the field and both values, before the base is loaded and with the file
unchanged. A file written before settings were recorded still resumes."""

from __future__ import annotations

import json

import pytest

from draftheads.cli import main
from draftheads.data.distill_settings import SettingsMismatchError, settings_path
from tests.data.data_fixtures import save_tiny_base, sharegpt_record, write_jsonl


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"))


def conversations(prefix: str, count: int = 3) -> list[dict]:
    return [sharegpt_record(f"c{i}", ("human", f"{prefix} {i}"), ("gpt", "old")) for i in range(count)]


def distill(base, source, out, *options: str) -> int:
    arguments = ["distill", "--base", str(base), "--data", str(source), "--out", str(out)]
    return main([*arguments, "--max-new-tokens", "3", "--batch-size", "2", *options])


def refusal(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("draftheads distill: "), err
    return err.removeprefix("draftheads distill: ").strip()


def forbid_loading_the_base(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr("draftheads.base_model.load_base", refuse)


def test_the_settings_are_recorded_beside_the_output(tmp_path, tiny_base):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question"))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out) == 0
    recorded = json.loads(settings_path(out).read_text())
    assert recorded["base"] == str(tiny_base) and recorded["source"] == str(source)
    assert len(recorded["source_sha256"]) == 64 and recorded["temperature"] == 0.0
    assert recorded["max_new_tokens"] == 3 and recorded["seed"] is None  # greedy: no seed
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["chats.jsonl", "distilled.jsonl", settings_path(out).name]
    )  # the temporary file it was written through is gone


def test_another_source_whose_ids_collide_is_refused(tmp_path, tiny_base, capsys, monkeypatch):
    first = write_jsonl(tmp_path / "first.jsonl", conversations("question"))
    second = write_jsonl(tmp_path / "second.jsonl", conversations("other question"))  # ids c0..c2 too
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, first, out) == 0
    written = out.read_bytes()
    capsys.readouterr()
    forbid_loading_the_base(monkeypatch)
    assert distill(tiny_base, second, out) != 0
    assert refusal(capsys) == (
        f"{out}: field 'source' is {str(first)!r} in {settings_path(out).name}, this run's "
        f"{str(second)!r}; a run made otherwise would mix its answers in: give another --out"
    )
    assert out.read_bytes() == written
    assert issubclass(SettingsMismatchError, FileExistsError)  # a refusal to write, for the CLI


def test_the_same_source_file_changed_is_refused(tmp_path, tiny_base, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question"))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out) == 0
    before = json.loads(settings_path(out).read_text())["source_sha256"]
    write_jsonl(source, conversations("rewritten question"))
    capsys.readouterr()
    forbid_loading_the_base(monkeypatch)
    assert distill(tiny_base, source, out) != 0
    assert f"field 'source_sha256' is {before!r}" in refusal(capsys)


def test_a_rerun_at_another_temperature_is_refused(tmp_path, tiny_base, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question", count=5))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out, "--limit", "2") == 0
    written = out.read_bytes()
    capsys.readouterr()
    forbid_loading_the_base(monkeypatch)
    assert distill(tiny_base, source, out, "--temperature", "0.8") != 0
    assert "field 'temperature' is 0.0" in refusal(capsys) and out.read_bytes() == written
    for option, field in [
        (["--max-new-tokens", "4"], "max_new_tokens"),
        (["--max-length", "64"], "max_length"),
        (["--dtype", "bfloat16"], "dtype"),
        (["--base", str(tmp_path / "other-base")], "base"),
    ]:
        arguments = ["distill", "--base", str(tiny_base), "--data", str(source), "--out", str(out)]
        assert main([*arguments, "--max-new-tokens", "3", *option]) != 0
        assert f"field '{field}' is " in refusal(capsys)
    assert out.read_bytes() == written


def test_same_settings_and_a_higher_limit_resume(tmp_path, tiny_base, capsys):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question", count=4))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out, "--limit", "2", "--seed", "5") == 0  # greedy: any seed
    assert distill(tiny_base, source, out, "--batch-size", "1") == 0
    assert "wrote 2 conversations" in capsys.readouterr().out
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["c0", "c1", "c2", "c3"]


def test_sampled_answers_record_their_seed(tmp_path, tiny_base, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question"))
    out = tmp_path / "sampled.jsonl"
    assert distill(tiny_base, source, out, "--temperature", "0.7", "--seed", "3", "--limit", "1") == 0
    capsys.readouterr()
    forbid_loading_the_base(monkeypatch)
    assert distill(tiny_base, source, out, "--temperature", "0.7", "--seed", "4") != 0
    assert "field 'seed' is 3 in" in refusal(capsys)


def test_an_output_from_before_settings_were_recorded_still_resumes(tmp_path, tiny_base, capsys):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question", count=3))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out, "--limit", "1") == 0
    settings_path(out).unlink()  # what distill wrote until it recorded its settings
    assert distill(tiny_base, source, out, "--temperature", "0.5") == 0
    printed = capsys.readouterr().out
    assert "wrote 2 conversations" in printed and "records no settings" in printed
    assert not settings_path(out).exists()  # its earlier answers' settings are unknown: none claimed


def test_a_damaged_settings_file_is_named(tmp_path, tiny_base, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "chats.jsonl", conversations("question"))
    out = tmp_path / "distilled.jsonl"
    assert distill(tiny_base, source, out, "--limit", "1") == 0
    settings_path(out).write_text('{"base": ')
    capsys.readouterr()
    forbid_loading_the_base(monkeypatch)
    assert distill(tiny_base, source, out) != 0
    assert refusal(capsys).startswith(f"{settings_path(out)}: not JSON")
