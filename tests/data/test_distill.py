"""draftheads distill on the tiny random model: writes N conversations, a re-run writes nothing new."""

from __future__ import annotations

import json

from data_fixtures import sharegpt_record, write_jsonl

from draftheads.cli import main
from draftheads.data.sources import read_conversations


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
