"""Resuming with other settings: a changed head or optimiser setting is refused naming each field
(old -> new); changed data or batch size only with an explicit opt-in, recorded in the head's
training record; run length, logging and cadence may change. And a warmup longer than the run
is warned about."""

from __future__ import annotations

import json

import pytest

from draftheads.settings import ConfigError
from draftheads.train.loop import run_training
from draftheads.train.resume import FREE_ON_RESUME, changed_settings, run_record, unrecorded_settings
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def trained(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    run_training(short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset))
    return tmp_path / "run", dataset


def _resume(output_dir, *overrides, head=None):
    extra = {} if head is None else {"head": head}
    return short_run(output_dir, "train.resume=true", "train.max_steps=6", *overrides, **extra)


def test_a_changed_head_or_optimiser_setting_is_refused_naming_each(trained, tiny_llama):
    output_dir, dataset = trained
    changed = _resume(output_dir, "head.num_heads=3", "train.learning_rate=0.01")
    with pytest.raises(ConfigError, match=r"(?s)head.num_heads: 2 -> 3.*train.learning_rate: 0.0003 -> 0.01"):
        run_training(changed, base_model=tiny_llama, datasets=(dataset, dataset))
    other_kind = _resume(output_dir, head=["head.kind=eagle"])
    with pytest.raises(ConfigError, match=r"head.kind: 'medusa' -> 'eagle'"):
        run_training(other_kind, base_model=tiny_llama, datasets=(dataset, dataset))


def test_changed_data_needs_the_opt_in_and_is_recorded(trained, tiny_llama):
    output_dir, dataset = trained
    changed = _resume(output_dir, "train.micro_batch_size=4", "data.source=more.jsonl")
    with pytest.raises(
        ConfigError, match=r"(?s)data.source: 'sharegpt' -> 'more.jsonl'.*--allow-changed-data"
    ):
        run_training(changed, base_model=tiny_llama, datasets=(dataset, dataset))
    summary = run_training(
        changed, base_model=tiny_llama, datasets=(dataset, dataset), allow_changed_data=True
    )
    assert summary.steps == 6
    history = json.loads((output_dir / "head" / "config.json").read_text())["training"]["data_history"]
    assert [(segment["from_step"], segment["settings"]["train.micro_batch_size"]) for segment in history] == [
        (0, 2),
        (4, 4),
    ]
    assert [segment["settings"]["data.source"] for segment in history] == ["sharegpt", "more.jsonl"]
    # The next resume compares with the changed run, and keeps the whole history.
    summary = run_training(
        _resume(output_dir, "train.micro_batch_size=4", "data.source=more.jsonl", "train.max_steps=8"),
        base_model=tiny_llama,
        datasets=(dataset, dataset),
    )
    assert summary.steps == 8 and [segment["from_step"] for segment in summary.data_history] == [0, 4]


def test_run_length_logging_and_cadence_may_change(trained, tiny_llama):
    output_dir, dataset = trained
    free = _resume(output_dir, "train.log_every=2", "train.eval_every=3", "train.keep_checkpoints=1")
    assert run_training(free, base_model=tiny_llama, datasets=(dataset, dataset)).steps == 6
    old = run_record({"train": {"max_steps": 4, "seed": 0, "grad_clip": 0.5}})
    new = run_record({"train": {"max_steps": 9, "seed": 1, "warmup_steps": 5}})
    assert [change.key for change in changed_settings(old, new)] == ["train.seed"]
    assert unrecorded_settings(old, new) == ["train.warmup_steps"]
    assert "train.max_steps" in FREE_ON_RESUME


def test_a_warmup_longer_than_the_run_is_warned_about(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    run = short_run(tmp_path / "run", "train.warmup_steps=10")
    with pytest.warns(UserWarning, match=r"train.warmup_steps \(10\) exceeds the run's 4 optimizer steps"):
        run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))
