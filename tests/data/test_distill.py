"""draftheads distill on the tiny random model: writes N conversations, a re-run writes nothing new;
an --out file that is not distill's own output is refused unchanged before the base is loaded."""

from __future__ import annotations

import json

import pytest
from data_fixtures import sharegpt_record, write_jsonl

from draftheads.cli import main
from draftheads.data.distill import written_ids
from draftheads.data.sources import DataError, read_conversations


def test_distill_writes_regenerated_conversations_and_resumes(tmp_path, tiny_base_dir, capsys):
    records = [
        sharegpt_record(
            f"c{i}",
            ("system", "Be brief."),
            ("human", f"q{i}"),
            ("gpt", "old answer"),
            ("human", "more?"),
            ("gpt", "old again"),
            ("human", "unanswered"),
        )
        for i in range(4)
    ]
    records.append(sharegpt_record("single", ("human", "hello"), ("gpt", "old")))
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    out = tmp_path / "out" / "distilled.jsonl"
    arguments = [
        "distill",
        "--base",
        str(tiny_base_dir),
        "--data",
        str(source),
        "--out",
        str(out),
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--limit",
        "4",
    ]
    assert main(arguments) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and "wrote 4 conversations" in capsys.readouterr().out
    first = json.loads(lines[0])
    assert first["id"] == "c0"
    assert [t["from"] for t in first["conversations"]] == ["system", "human", "gpt", "human", "gpt"]
    assert [t["value"] for t in first["conversations"] if t["from"] != "gpt"] == ["Be brief.", "q0", "more?"]
    assert all(t["value"] != "old answer" for t in first["conversations"])

    assert main(arguments) == 0  # re-run: everything is already there
    assert out.read_text().splitlines() == lines
    assert "wrote 0 conversations" in capsys.readouterr().out

    # an interrupted write leaves a partial line: it is cut off, and the rest of the source is added
    out.write_text(out.read_text() + '{"id": "c9", "conv')
    assert main(arguments[:-2]) == 0
    conversations, report = read_conversations(str(out))
    assert [c.id for c in conversations] == ["c0", "c1", "c2", "c3", "single"] and report.dropped == {}


def test_greedy_distill_is_deterministic(tmp_path, tiny_base_dir):
    source = write_jsonl(tmp_path / "chats.jsonl", [sharegpt_record("a", ("human", "hi"), ("gpt", "x"))])
    outputs = []
    for name in ("one.jsonl", "two.jsonl"):
        out = tmp_path / name
        main(
            [
                "distill",
                "--base",
                str(tiny_base_dir),
                "--data",
                str(source),
                "--out",
                str(out),
                "--max-new-tokens",
                "5",
            ]
        )
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]


def test_conversation_stops_where_the_prompt_reaches_max_length(tmp_path, tiny_base_dir, capsys):
    record = sharegpt_record("a", ("human", "first"), ("gpt", "x"), ("human", "second " * 10), ("gpt", "y"))
    source = write_jsonl(tmp_path / "chats.jsonl", [record])
    out = tmp_path / "out.jsonl"
    arguments = ["distill", "--base", str(tiny_base_dir), "--data", str(source), "--out", str(out)]
    assert main([*arguments, "--max-new-tokens", "4", "--max-length", "110"]) == 0
    turns = json.loads(out.read_text())["conversations"]
    assert [t["from"] for t in turns] == [
        "human",
        "gpt",
    ] and "1 stopped at --max-length" in capsys.readouterr().out


OWN_RECORD = json.dumps(sharegpt_record("c0", ("human", "q"), ("gpt", "a"))).encode() + b"\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"keep me 1\nkeep me 2", "line 1: not JSON"),
        (b'{"conversations": []}\n', "line 1: no 'id'"),
        (b'{"id": "p", "turns": ["hi"]}\n', "line 1: no 'conversations' list"),
        (b'"text"\n', "line 1: not a JSON object but str"),
        (OWN_RECORD + b"\xff\xfe\n", "line 2: not UTF-8 text"),
        (OWN_RECORD + b"keep me", "line 2 \\(no newline at its end\\): not the start of a record"),
        (b'{"id": "p", "turns": ["hi"]}', "line 1 \\(no newline at its end\\): no 'conversations'"),
    ],
)
def test_an_out_file_that_is_not_distills_output_is_refused_unchanged(tmp_path, content, message):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    with pytest.raises(DataError, match=f"notes.txt {message}.*give another --out"):
        written_ids(notes)
    assert notes.read_bytes() == content


def test_only_an_interrupted_record_is_cut_off(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    for partial in (b'{"id": "c1", "conv', b'{"i', OWN_RECORD.rstrip(b"\n")):
        out.write_bytes(OWN_RECORD + b"\n" + partial)
        assert written_ids(out) == {"c0"}
        assert out.read_bytes() == OWN_RECORD + b"\n"
        assert f"dropping an incomplete last line ({len(partial)} bytes)" in capsys.readouterr().out
    assert written_ids(tmp_path / "none.jsonl") == set()


def test_the_command_refuses_a_foreign_out_before_loading_the_base(tmp_path, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr("draftheads.base_model.load_base", no_loading)
    source = write_jsonl(tmp_path / "chats.jsonl", [sharegpt_record("a", ("human", "hi"), ("gpt", "x"))])
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"keep me 1\nkeep me 2")
    arguments = ["distill", "--base", str(tmp_path / "no-base"), "--data", str(source), "--out", str(notes)]
    assert main(arguments) == 3
    error = capsys.readouterr().err
    assert error.startswith(f"draftheads distill: {notes} line 1: not JSON") and error.count("\n") == 1
    assert notes.read_bytes() == b"keep me 1\nkeep me 2"


@pytest.mark.parametrize("value", ["1", "-5"])
def test_max_length_must_be_positive(tmp_path, value, capsys):
    arguments = ["distill", "--data", "x.jsonl", "--out", str(tmp_path / "o.jsonl"), "--max-length", value]
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert f"--max-length: must be >= 2, got {value}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, message",
    [
        (["--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
        (["--temperature", "nan"], "argument --temperature: must be >= 0, got nan"),
        (["--dtype", "fp64"], "argument --dtype: expected auto or one of"),
        (["--device", "gpu0"], "argument --device: not a torch device: 'gpu0'"),
    ],
)
def test_bad_sampling_and_model_options_are_refused_before_any_work(tmp_path, option, message, capsys):
    arguments = ["distill", "--data", "x.jsonl", "--out", str(tmp_path / "o.jsonl"), *option]
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_out_that_is_a_directory_is_refused(tmp_path):
    from draftheads.data.distill import written_ids
    from draftheads.data.sources import DataError

    with pytest.raises(DataError, match=r"not a file; give --out a file path \(distill writes JSON lines\)"):
        written_ids(tmp_path)
