"""An export carries no local paths: config.json has no ``_name_or_path`` (transformers records the
directory the base was loaded from, e.g. a cache path), and the model card and bench.json name
data files, run directories and heads by file name only; Hub ids stay as they are."""

from __future__ import annotations

import json

import pytest

from draftheads.export import export_head, formats_for
from draftheads.export.public import public_name, strip_local_paths
from draftheads.heads import build_head
from draftheads.heads.medusa import MedusaConfig

CACHE = "/root/.cache/draftheads/models/SmolLM2-135M-Instruct.Q4_1-03bc94583cbf5dff"
TRAINING = {
    "steps": 4,
    "data_source": "/home/someone/corpora/sharegpt-part (first 2000) + docs/results/corpus/later",
    "head_dir": "/home/someone/runs/medusa/head",
    "data_history": [
        {
            "from_step": 0,
            "source": "/home/someone/corpora/sharegpt-part (first 2000)",
            "settings": {"data.source": "/home/someone/corpora/sharegpt-part", "data.features": "runs/f/x"},
        }
    ],
}
BENCH = {
    "settings": {"heads": ["/tmp/untrained-medusa"], "prompts": "/home/someone/prompts.jsonl"},
    "summaries": [{"method": "medusa", "category": "all", "tau": 1.5, "speedup": 1.2}],
}
LOCAL = ("/home/someone", "/root/.cache", "/tmp/", "docs/results", "runs/")


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    tiny_llama.config._name_or_path = CACHE  # as transformers records a base loaded from a directory
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    directory = head.save_pretrained(tmp_path / "head", extra={"training": TRAINING})
    (directory / "bench.json").write_text(json.dumps(BENCH))
    return directory


@pytest.mark.parametrize("format_name", formats_for("medusa"))
def test_an_export_names_no_local_path(head_dir, tmp_path, format_name):
    out = tmp_path / "out"
    files = export_head(head_dir, out, format_name)
    config = json.loads((out / "config.json").read_text())
    assert "_name_or_path" not in json.dumps(config)
    for path in files:
        if path.suffix in (".json", ".md"):
            text = path.read_text()
            assert not [local for local in LOCAL if local in text], (path.name, text)
    card = (out / "README.md").read_text()
    assert "| training data | sharegpt-part (first 2000) + later |" in card


def test_a_saved_head_records_no_cache_path(head_dir):
    assert CACHE not in (head_dir / "config.json").read_text()


@pytest.mark.parametrize(
    ("given", "published"),
    [
        ("/home/someone/data/train.jsonl", "train.jsonl"),
        ("data/train.jsonl", "train.jsonl"),
        ("~/corpora/sharegpt/", "sharegpt"),
        ("docs/results/corpus/smollm2-sharegpt", "smollm2-sharegpt"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("sharegpt", "sharegpt"),
        ("https://huggingface.co/datasets/a/b", "https://huggingface.co/datasets/a/b"),
    ],
)
def test_local_paths_become_file_names_and_hub_ids_stay(given, published):
    assert public_name(given) == published


def test_text_and_nested_records_are_stripped_in_place():
    record = {"a": ["/x/y/z.json and more", 3, None], "b": {"c": "org/model"}}
    assert strip_local_paths(record) == {"a": ["z.json and more", 3, None], "b": {"c": "org/model"}}
