"""draftheads data inspect through the CLI entry point."""

from __future__ import annotations

from data_fixtures import sharegpt_record, write_jsonl

from draftheads.cli import main


def test_data_inspect_prints_the_report(tmp_path, tiny_base_dir, capsys):
    records = [
        sharegpt_record(f"c{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(12)
    ]
    records += ['{"id": "bad"', sharegpt_record("alien", ("human", "hi"), ("robot", "beep"))]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    config = tmp_path / "run.yaml"  # no head: section
    config.write_text(
        f"model:\n  base: {tiny_base_dir}\ndata:\n  source: {source}\n  validation_size: 2\n"
        f"  cache_dir: {tmp_path / 'cache'}\n"
    )
    # 2 of 14 records dropped (14.3%) is more than the default data.max_drop_fraction
    assert main(["data", "inspect", "--config", str(config), "data.max_length=256"]) == 3  # bad input
    assert "chats.jsonl: 2 of 14 records dropped (14.3%)" in capsys.readouterr().err
    config.write_text(config.read_text() + "  max_drop_fraction: 0.2\n")
    assert main(["data", "inspect", "--config", str(config), "data.max_length=256"]) == 0
    out = capsys.readouterr().out
    assert "conversations read: 14" in out and "usable conversations: 12" in out
    assert "dropped: 2 (2 malformed or unusable records, 14.3% of those read)" in out
    assert "examples kept: 12 (train 10, validation 2)" in out
    assert "invalid_json: 1" in out and "e.g. chats.jsonl line 13:" in out
    assert "unknown_role: 1" in out and "turn 1 has role 'robot'" in out
    assert "assistant-token share" in out and "length histogram" in out and "built and cached" in out
    assert "of the positions micro-batches of 4 compute; 1 rank(s) wait 0.0%" in out
    assert main(["data", "inspect", "--config", str(config), "data.max_length=256", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "cache hit" in out and "2 rank(s) wait" in out
    assert main(["data", "inspect", "--config", str(config), "--ranks", "0"]) == 3
    assert "--ranks 0: must be at least 1" in capsys.readouterr().err
