"""Saving a run's head replaces the files the save writes and keeps the rest: the tree `tune-tree`
chose (tree.json) and a user's own files survive a resumed run's save, and a `draftheads`-format
export carries tree.json and a fitted confidence head along."""

from __future__ import annotations

import json

import pytest

from draftheads.export.exporter import export_head
from draftheads.infer.confidence import (
    CONFIDENCE_CONFIG,
    CONFIDENCE_FILE,
    ConfidenceHead,
    load_confidence,
    save_confidence,
)
from draftheads.train.loop import run_training
from tests.reliability.train_fixtures import patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")

TREE = {"format": "draftheads-tuned-tree", "trees": {}}  # what survives is the bytes, not their meaning


@pytest.fixture
def finished(tmp_path, tiny_llama):
    dataset = patterned_dataset()
    run_training(short_run(tmp_path / "run"), base_model=tiny_llama, datasets=(dataset, dataset))
    return tmp_path / "run", dataset


def test_a_resumed_runs_head_save_keeps_tree_json_and_the_users_files(finished, tiny_llama):
    output_dir, dataset = finished
    head = output_dir / "head"
    (head / "tree.json").write_text(json.dumps(TREE) + "\n")
    (head / "notes").mkdir()
    (head / "notes" / "mine.txt").write_text("keep me\n")
    old_weights = (head / "model.safetensors").read_bytes()
    resumed = short_run(output_dir, "train.resume=true", "train.max_steps=6")
    assert run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset)).steps == 6
    assert json.loads((head / "tree.json").read_text()) == TREE
    assert (head / "notes" / "mine.txt").read_text() == "keep me\n"
    assert json.loads((head / "config.json").read_text())["training"]["steps"] == 6
    assert (head / "model.safetensors").read_bytes() != old_weights
    leftovers = [path.name for path in output_dir.iterdir() if path.name.startswith(".tmp-")]
    assert leftovers == []


def test_a_draftheads_export_carries_tree_json_and_the_confidence_head(finished, tmp_path):
    output_dir, _ = finished
    (output_dir / "head" / "tree.json").write_text(json.dumps(TREE) + "\n")
    source = str(tmp_path / "private" / "chats.jsonl")
    save_confidence(ConfidenceHead(), output_dir / "head", {"settings": {"data": source}})
    written = export_head(output_dir / "head", tmp_path / "export", "draftheads")
    assert tmp_path / "export" / "tree.json" in written
    assert json.loads((tmp_path / "export" / "tree.json").read_text()) == TREE
    exported = tmp_path / "export"
    assert (exported / CONFIDENCE_FILE).read_bytes() == (output_dir / "head" / CONFIDENCE_FILE).read_bytes()
    record = json.loads((exported / CONFIDENCE_CONFIG).read_text())
    assert record["settings"]["data"] == "chats.jsonl"  # local paths by file name only, as in the card
    load_confidence(exported)  # the copy loads
