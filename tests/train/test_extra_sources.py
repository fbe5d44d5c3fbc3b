"""``data.extra_sources``: a second conversation source joins the training split; a feature cache
of the first source's rows is extended with the second's, not rewritten, and training from it
follows online training on the same rows."""

from __future__ import annotations

import json

import pytest
from distributed_launch import empty_config, run_options, write_conversations, write_tiny_base

from draftheads.cli import main
from draftheads.config import load_run_config
from draftheads.data.feature_identity import FeatureCacheError
from draftheads.train.data_history import describe_data, source_range
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics


def test_a_cache_of_one_source_is_extended_by_an_extra_source_and_trains(tmp_path, capsys):
    everything = write_conversations(tmp_path / "all.jsonl", count=36)
    lines = everything.read_text().splitlines(keepends=True)
    first, extra = tmp_path / "first.jsonl", tmp_path / "extra.jsonl"
    first.write_text("".join(lines[:26]))
    extra.write_text("".join(lines[26:]))
    base = write_tiny_base(tmp_path / "base", everything)
    config = empty_config(tmp_path)
    features = tmp_path / "features"
    shards = ["--examples-per-shard", "5", "--dtype", "float32", "--no-progress"]

    def options(output_dir, *more):
        return [*run_options(base, first, output_dir, "eagle3", 0), f"data.features={features}", *more]

    with_extra = f"data.extra_sources=[{extra}]"
    assert main(["cache-features", "--config", str(config), *options(tmp_path / "x"), *shards]) == 0
    index = json.loads((features / "index.json").read_text())
    assert index["identity"]["examples"] == {"train": 24, "validation": 2}

    # the cache lacks the extra rows: refused, pointing at cache-features
    run = load_run_config(config, [*options(tmp_path / "refused", with_extra), "train.max_steps=2"])
    with pytest.raises(FeatureCacheError, match="cache-features.*data.extra_sources"):
        run_training(run)

    capsys.readouterr()
    assert (
        main(["cache-features", "--config", str(config), *options(tmp_path / "x", with_extra), *shards]) == 0
    )
    assert "split 'train' grew from 24 to 34 rows; keeping its first 4 shards" in capsys.readouterr().out
    index = json.loads((features / "index.json").read_text())
    assert index["identity"]["examples"] == {"train": 34, "validation": 2}
    assert index["complete_shards"] == {"train": 7, "validation": 1}

    offline = run_training(load_run_config(config, options(tmp_path / "offline", with_extra)))
    assert offline.train_examples == 34 and offline.data_source == f"{first} + {extra}"
    online_options = [*options(tmp_path / "online", with_extra), "data.features=null"]
    online = run_training(load_run_config(config, online_options))
    losses = {
        name: [
            entry["loss"]
            for entry in read_metrics(tmp_path / name)
            if "loss" in entry and "eval" not in entry
        ]
        for name in ("offline", "online")
    }
    assert len(losses["offline"]) == 6
    assert losses["offline"] == pytest.approx(losses["online"], rel=1e-4)
    assert offline.eval["top1"] == pytest.approx(online.eval["top1"], abs=1e-6)


def test_a_cache_written_with_the_base_in_bf16_trains_the_fp32_run(tmp_path):
    """``cache-features --compute-dtype bfloat16``: the index records the dtype the base ran in, and
    a run whose base is fp32 (the default on CPU) trains from the cache."""
    conversations = write_conversations(tmp_path / "all.jsonl", count=12)
    base = write_tiny_base(tmp_path / "base", conversations)
    config = empty_config(tmp_path)
    features = tmp_path / "features"
    options = [*run_options(base, conversations, tmp_path / "x", "eagle3", 0), f"data.features={features}"]
    shards = ["--examples-per-shard", "5", "--no-progress", "--compute-dtype", "bfloat16"]
    assert main(["cache-features", "--config", str(config), *options, *shards]) == 0
    assert json.loads((features / "index.json").read_text())["compute_dtype"] == "bfloat16"
    run = load_run_config(config, [*options, "train.max_steps=2", f"train.output_dir={tmp_path / 'run'}"])
    assert run.model.dtype in ("auto", "float32")
    run_training(run)
    assert read_metrics(tmp_path / "run")[-1]["step"] == 2


def test_a_run_summary_names_the_conversations_it_read():
    assert source_range(0, None) == "" and source_range(0, 6000) == " (first 6000)"
    assert source_range(6000, 5000) == " (6000 to 11000)" and source_range(6000, None) == " (from 6000)"
    record = {"data": {"source": "sharegpt", "skip": 6000, "limit": 7000}}
    assert describe_data(record, given=False) == "sharegpt (6000 to 13000)"  # the data history's label
    assert describe_data({"data": {"source": "s.jsonl", "limit": 10}}, given=False) == "s.jsonl (first 10)"
