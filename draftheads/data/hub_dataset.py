"""A Hub dataset source, ``org/name`` or ``org/name@revision``, pinned to the commit it resolves to.

A Hub dataset changes under its name: the tokenised-data cache keyed by the name alone would keep
serving an old commit's rows after the dataset is updated. So the revision (the one given after
``@``, else ``main``) is resolved to its commit once, the cache is keyed by that commit, and that
commit is what ``load_dataset`` reads (``revision=``). Offline, the commit is the one the local
Hugging Face cache recorded for the revision (``refs/<revision>``); when neither is known the key
names the revision as given, and the data is what ``datasets`` finds in its own cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from draftheads.data.sources import DataError

DEFAULT_REVISION = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubDataset:
    name: str  # the repository id, org/name
    revision: str | None  # as given after '@'; None: the default branch


def parse_hub_dataset(source: str) -> HubDataset:
    """``org/name@revision`` -> its parts (a repository id holds no '@')."""
    name, separator, revision = source.partition("@")
    if separator and not revision:
        raise DataError(f"data source '{source}': nothing after '@'; give a revision (branch, tag or commit)")
    return HubDataset(name, revision or None)


def cached_commit(name: str, revision: str) -> str | None:
    """The commit the local Hugging Face cache recorded for ``revision`` of dataset ``name``."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    ref = (
        Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name, repo_type="dataset") / "refs" / revision
    )
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.fullmatch(commit) else None


def resolve_commit(dataset: HubDataset) -> str | None:
    """The commit ``dataset``'s revision names: asked of the Hub, else the local cache's record,
    else None."""
    revision = dataset.revision or DEFAULT_REVISION
    if COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(dataset.name, revision=revision).sha
    except Exception:  # noqa: BLE001 - offline, unreachable, unknown: load_dataset reports its own error
        return cached_commit(dataset.name, revision)


def pinned_source(source: str) -> str:
    """``source`` with a Hub dataset's revision replaced by its commit (``org/name@<commit>``),
    when it resolves; any other source unchanged."""
    from draftheads.data.sources import resolve_source

    kind, location = resolve_source(source)
    if kind != "dataset" or Path(str(location)).exists():
        return source
    dataset = parse_hub_dataset(source)
    commit = resolve_commit(dataset)
    return f"{dataset.name}@{commit}" if commit else source
