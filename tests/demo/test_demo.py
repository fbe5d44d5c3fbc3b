"""The demo pipeline end to end on the tiny random Llama with tiny settings: every stage runs, the
outputs land in the demo directory, and a re-run reuses them (the full demo is never run here)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from draftheads.demo import DemoSettings, run_demo
from tests.data.data_fixtures import save_tiny_base, save_tiny_gemma3_base, sharegpt_record, write_jsonl

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def tiny_settings(tmp_path):
    save_tiny_base(tmp_path / "base")
    records = [
        sharegpt_record(
            f"c{i}", ("human", f"Question {i}?"), ("gpt", "old answer"), ("human", "more"), ("gpt", "x")
        )
        for i in range(12)
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    return DemoSettings(
        out_dir=str(tmp_path / "demo"),
        base=str(tmp_path / "base"),
        source=str(source),
        conversations=8,
        distill_max_new_tokens=12,
        distill_batch_size=4,
        max_length=160,
        train_steps=3,
        micro_batch_size=2,
        save_every=2,
        # the tiny Llama has 4 layers and a 258-token vocabulary
        train_overrides=("head.feature_layers=[1,2,3]", "head.draft_vocab_size=64", "head.ttt_steps=2"),
        tune_prompts=2,
        tune_max_new_tokens=10,
        tune_max_nodes=8,
        tune_repeats=1,
        max_new_tokens=12,
        warmup_tokens=2,
    )


def test_demo_runs_every_stage_then_reuses_them(tiny_settings, capsys):
    record = run_demo(tiny_settings)
    out = capsys.readouterr().out
    for stage in ("1/5 distill", "2/5 train", "3/5 tune", "4/5 generate", "5/5 shipped"):
        assert stage in out
    # the shipped SmolLM2 head does not draft for the tiny Llama: stage 5 says so and goes on
    assert "skipped: the shipped head does not draft for" in out and record["shipped"] is None
    demo_dir = tiny_settings.out_dir
    lines = Path(f"{demo_dir}/distilled.jsonl").read_text().splitlines()
    assert len(lines) == 8
    first = json.loads(lines[0])["conversations"]
    assert [t["from"] for t in first] == ["human", "gpt"] and first[1][
        "value"
    ] != "old answer"  # first exchange
    head_config = json.loads(Path(f"{demo_dir}/eagle3/head/config.json").read_text())
    assert head_config["head_kind"] == "eagle3" and head_config["training"]["steps"] == 3
    assert json.loads(Path(f"{demo_dir}/eagle3/head/tree.json").read_text())["trees"]["cpu/float32"]
    assert record["tree"].startswith("tuned")
    assert record["identical"] is True  # greedy speculative decoding is lossless in fp32
    assert record["tau"] >= 1.0 and record["plain_tokens"] == 12 and record["runs"] == 3
    assert (record["speedup"] is None) == record["machine_busy"]  # a busy test machine: no figure
    assert "speedup" in out and "outputs identical: yes" in out
    saved = json.loads(Path(f"{demo_dir}/demo.json").read_text())
    assert saved["times"]["train"] > 0 and saved["times"]["reused"] == []

    again = run_demo(tiny_settings)
    out = capsys.readouterr().out
    assert "reusing the trained head" in out and "reusing the tuned tree" in out
    assert again["times"]["reused"] == ["train", "tune"]
    assert len(Path(f"{demo_dir}/distilled.jsonl").read_text().splitlines()) == 8


def test_a_base_without_a_chat_template_runs_every_stage_on_plain_dialogue(tiny_settings, tmp_path, capsys):
    """The tiny Gemma 3 over a byte tokenizer without a chat template (a pretrained base): distilled,
    trained, tuned and asked in plain dialogue; the head's answer is plain generate's."""
    base = save_tiny_gemma3_base(tmp_path / "gemma")
    record = run_demo(dataclasses.replace(tiny_settings, base=str(base), shipped_head=None))
    assert record["identical"] is True and record["tree"].startswith("tuned")
    assert "outputs identical: yes" in capsys.readouterr().out


def test_the_shipped_head_answers_the_same_question(tiny_settings, capsys, tmp_path):
    run_demo(dataclasses.replace(tiny_settings, tune=False, shipped_head=None))
    shipped = tmp_path / "shipped"
    shutil.copytree(f"{tiny_settings.out_dir}/eagle3/head", shipped)
    capsys.readouterr()
    record = run_demo(dataclasses.replace(tiny_settings, tune=False, shipped_head=str(shipped)))
    out = capsys.readouterr().out
    assert f"eagle3 head from {shipped}, 3 training steps" in out
    assert record["shipped"]["identical"] is True and record["shipped"]["plain_tokens"] == 12
    assert record["shipped"]["runs"] == tiny_settings.timed_repeats  # its own interleaved plain runs
    assert out.count("outputs identical: yes") == 2

    missing = run_demo(dataclasses.replace(tiny_settings, tune=False, shipped_head=str(tmp_path / "none")))
    assert missing["shipped"] is None and "skipped: no head at" in capsys.readouterr().out


def test_an_interrupted_training_resumes(tiny_settings, capsys):
    run_demo(dataclasses.replace(tiny_settings, tune=False))
    demo_dir = tiny_settings.out_dir
    # as if stopped after step 2: the head is missing, the step-2 checkpoint is there
    shutil.rmtree(f"{demo_dir}/eagle3/head")
    shutil.rmtree(f"{demo_dir}/eagle3/checkpoints/step-00000003")
    record = run_demo(dataclasses.replace(tiny_settings, tune=False))
    out = capsys.readouterr().out
    assert "resuming" in out and "step-00000002 at step 2" in out
    assert record["tree"] == "dynamic-cpu"  # not tuned: the generator's default
    assert json.loads(Path(f"{demo_dir}/eagle3/head/config.json").read_text())["training"]["steps"] == 3


def test_demo_command_rejects_bad_numbers(capsys):
    from draftheads.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--train-steps", "0"])
    assert exit_info.value.code == 2
    assert "argument --train-steps: must be >= 1, got 0" in capsys.readouterr().err
