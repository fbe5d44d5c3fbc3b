"""``draftheads cache-features`` as 2 gloo processes: each writes its share of the shards, rank 0
the one index, and the cache is byte for byte the one a single process writes, so training reads
it whatever its own world size."""

from __future__ import annotations

import json

from distributed_launch import (
    DRAFTHEADS,
    empty_config,
    launch,
    run_options,
    write_conversations,
    write_tiny_base,
)

from draftheads.cli import main
from draftheads.config import load_run_config
from draftheads.train.loop import run_training


def test_two_ranks_write_the_cache_one_process_writes(tmp_path):
    conversations = write_conversations(tmp_path / "conversations.jsonl")
    base = write_tiny_base(tmp_path / "base", conversations)
    config = empty_config(tmp_path)
    shards = ["--examples-per-shard", "3", "--dtype", "float32", "--no-progress"]

    def options(features, output_dir):
        return [*run_options(base, conversations, output_dir, "eagle3", 0), f"data.features={features}"]

    two = tmp_path / "features-2"
    result = launch(
        2,
        [str(DRAFTHEADS), "cache-features", "--config", str(config), *options(two, tmp_path / "x"), *shards],
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    # 8 train shards of 3 examples and 1 validation shard of 2, dealt round-robin per split.
    assert "rank 0/2: wrote 14 examples in 5 shards" in result.stdout
    assert "rank 1/2: wrote 12 examples in 4 shards" in result.stdout
    one = tmp_path / "features-1"
    assert main(["cache-features", "--config", str(config), *options(one, tmp_path / "x"), *shards]) == 0

    index = json.loads((two / "index.json").read_text())
    assert index == json.loads((one / "index.json").read_text())
    assert index["complete_shards"] == {"train": 8, "validation": 1}  # 24 and 2 examples
    written = sorted(path.relative_to(one) for path in one.rglob("*.safetensors"))
    assert written == sorted(path.relative_to(two) for path in two.rglob("*.safetensors"))
    for path in written:
        assert (two / path).read_bytes() == (one / path).read_bytes(), path

    # One process trains from the cache two wrote.
    run = load_run_config(config, [*options(two, tmp_path / "trained"), "train.max_steps=2"])
    summary = run_training(run)
    assert summary.steps == 2
