"""A feature cache is written only into a directory that is absent, empty, or a cache of its own
(its index, or the marker a new cache writes first), and its clean-up removes only shards its index
names: ``data.features`` pointing at a directory of a user's files refuses (exit 6, naming the
directory) and leaves every file as it was."""

from __future__ import annotations

import datasets
import pytest
import torch

from draftheads.cli import EXIT_REFUSED, exit_status
from draftheads.data import feature_reader
from draftheads.data.feature_identity import CacheIdentity
from draftheads.data.feature_reader import FeatureCache
from draftheads.data.features import write_feature_cache
from draftheads.heads import build_head
from draftheads.heads.medusa import MedusaConfig

OPTIONS = {"dtype": "float32", "examples_per_shard": 2, "progress": False}


def _rows(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 250, (8,), generator=generator).tolist() for _ in range(count)]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[0, 0] + [1] * 6 for _ in ids]})


@pytest.fixture
def cache_job(tiny_llama):
    """(splits, identity) of a three-row cache for a Medusa head on the tiny Llama."""
    splits = {"train": _rows(3), "validation": _rows(1, seed=1)}
    head = build_head(tiny_llama, MedusaConfig(num_heads=2))
    return splits, CacheIdentity.build(tiny_llama, "tiny", None, head, splits, max_length=16)


def _files(directory):
    return {path.relative_to(directory): path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def test_a_directory_of_a_users_files_is_refused_and_left_as_it_was(tmp_path, tiny_llama, cache_job):
    directory = tmp_path / "mine"
    (directory / "archive").mkdir(parents=True)
    (directory / "archive" / "shard-00007.safetensors").write_bytes(b"the user's own data")
    (directory / "notes.txt").write_text("mine\n")
    before = _files(directory)
    with pytest.raises(FileExistsError) as caught:
        write_feature_cache(tiny_llama, cache_job[0], directory, cache_job[1], **OPTIONS)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and str(directory) in message and "notes.txt" in message
    assert exit_status(caught.value) == EXIT_REFUSED
    assert _files(directory) == before and sorted(p.name for p in directory.iterdir()) == [
        "archive",
        "notes.txt",
    ]


def test_a_new_or_empty_directory_becomes_a_cache_that_resumes(tmp_path, tiny_llama, cache_job):
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "new", tmp_path / "empty"):
        write_feature_cache(tiny_llama, cache_job[0], directory, cache_job[1], **OPTIONS)
        FeatureCache(directory).check(cache_job[1])
        again = write_feature_cache(tiny_llama, cache_job[0], directory, cache_job[1], **OPTIONS)
        assert again.written_examples == 0  # its own cache: resumed, nothing left to write


def test_growing_a_cache_removes_only_the_shards_its_index_names(tmp_path, tiny_llama, cache_job):
    splits, identity = cache_job
    directory = tmp_path / "cache"
    write_feature_cache(tiny_llama, splits, directory, identity, **OPTIONS)
    stranger = feature_reader.shard_path(directory, "train", 7)  # a shard number the cache never had
    stranger.write_bytes(b"not the cache's")
    more = datasets.concatenate_datasets([splits["train"], _rows(2, seed=2)])  # an extra source's rows
    grown = {"train": more, "validation": splits["validation"]}
    head = build_head(tiny_llama, MedusaConfig(num_heads=2))
    grown_identity = CacheIdentity.build(tiny_llama, "tiny", None, head, grown, max_length=16)
    summary = write_feature_cache(tiny_llama, grown, directory, grown_identity, **OPTIONS)
    assert summary.written_examples == 3  # the cache's partial last shard again, and the new rows
    assert stranger.read_bytes() == b"not the cache's"
