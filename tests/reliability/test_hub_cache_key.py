"""The tokenised-data cache of a Hub dataset is keyed by the commit its revision resolves to, and that
commit is what is loaded: a dataset updated on the Hub is built again, and ``org/name@revision``
reads that revision. Only the Hub is simulated: its commit lookup, and its files served per commit
from local JSON Lines files through the real ``load_dataset``."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import huggingface_hub
import pytest

from draftheads.config import DataConfig
from draftheads.data.pipeline import build_datasets
from tests.data.data_fixtures import make_byte_tokenizer, sharegpt_record, write_jsonl

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub holding ``org/chats`` at two commits; ``hub.main`` is the commit ``main`` points to."""
    files = {}
    for commit, prefix in ((COMMIT_A, "a"), (COMMIT_B, "b")):
        chats = [
            sharegpt_record(f"{prefix}{i}", ("human", f"q{i}"), ("gpt", f"answer {i}")) for i in range(6)
        ]
        files[commit] = write_jsonl(tmp_path / f"{prefix}.jsonl", chats)
    state = SimpleNamespace(main=COMMIT_A, loaded=[])

    def dataset_info(self, repo_id, revision=None, **kwargs):
        assert repo_id == "org/chats"
        return SimpleNamespace(sha=state.main if revision in (None, "main") else revision)

    real_load = datasets.load_dataset

    def load_dataset(path, split=None, revision=None, **kwargs):
        assert path == "org/chats"
        commit = state.main if revision in (None, "main") else revision
        state.loaded.append(commit)
        return real_load("json", data_files=str(files[commit]), split=split)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return state


def ids(train, validation) -> set[str]:
    return set(train["id"]) | set(validation["id"])


def test_a_hub_dataset_updated_on_the_hub_is_built_again(tmp_path, hub):
    tokenizer = make_byte_tokenizer()
    data = DataConfig(source="org/chats", validation_size=1, max_length=256, cache_dir=str(tmp_path / "c"))
    train, validation, report = build_datasets(data, tokenizer, "tiny")
    assert ids(train, validation) == {f"a{i}" for i in range(6)}
    hub.main = COMMIT_B  # a new commit on main
    train, validation, report = build_datasets(data, tokenizer, "tiny")
    assert not report.cache_hit and ids(train, validation) == {f"b{i}" for i in range(6)}
    assert hub.loaded == [COMMIT_A, COMMIT_B]  # what was keyed is what was loaded
    assert build_datasets(data, tokenizer, "tiny")[2].cache_hit


def test_a_revision_given_with_the_name_is_read_and_keyed(tmp_path, hub):
    tokenizer = make_byte_tokenizer()
    hub.main = COMMIT_B
    data = DataConfig(
        source=f"org/chats@{COMMIT_A}", validation_size=1, max_length=256, cache_dir=str(tmp_path)
    )
    train, validation, report = build_datasets(data, tokenizer, "tiny")
    assert ids(train, validation) == {f"a{i}" for i in range(6)} and hub.loaded == [COMMIT_A]
    latest = DataConfig(source="org/chats", validation_size=1, max_length=256, cache_dir=str(tmp_path))
    train, validation, report = build_datasets(latest, tokenizer, "tiny")
    assert not report.cache_hit and ids(train, validation) == {f"b{i}" for i in range(6)}
