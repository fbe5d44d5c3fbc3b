"""What of a local run may be published: local paths become file names, Hub ids stay.

A head's training record names the data it saw and where it was written (``/home/<user>/...``,
a cache directory, a checkout's ``docs/results/...``), and ``bench.json`` names the heads and
prompt files it ran. An export (and so the Hub) gets only their file names: enough to tell sources
apart, nothing about the machine. A Hub id (``owner/name``) or URL is public already and stays.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePath
from typing import Any

# A name ending in one of these is a file, even with a single slash (``data/train.jsonl``).
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".gz", ".safetensors", ".bin", ".pt", ".pth", ".txt", ".yaml")
_LOCAL_START = ("/", "~", "./", "../", "\\")
_WINDOWS_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")
_TOKEN = re.compile(r"[^\s(),;'\"`]+")  # a word of free text that may be a path


def is_local_path(text: str) -> bool:
    """Does ``text`` (one word) name a local file or directory rather than a Hub id or URL? Local:
    absolute, home- or dot-relative, more than ``owner/name`` deep, a file name with a path, or a
    relative path that exists here."""
    if not text or "://" in text or not any(c.isalpha() for c in text):
        return False
    if text.startswith(_LOCAL_START) or _WINDOWS_DRIVE.match(text) or "\\" in text:
        return True
    if "/" not in text:
        return False  # a bare name ("sharegpt", "train.jsonl") says nothing about the machine
    parts = [part for part in text.split("/") if part]
    return len(parts) > 2 or text.lower().endswith(FILE_SUFFIXES) or Path(text).exists()


def public_name(text: str) -> str:
    """``text``'s file name if it is a local path (``is_local_path``), else ``text``."""
    return PurePath(text.replace("\\", "/").rstrip("/")).name if is_local_path(text) else text


def strip_local_paths(value: Any) -> Any:
    """A copy of a JSON value (dicts, lists, strings, numbers) with every local path in its strings,
    free text included, replaced by its file name."""
    if isinstance(value, dict):
        return {key: strip_local_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [strip_local_paths(item) for item in value]
    if isinstance(value, str):
        return _TOKEN.sub(lambda match: public_name(match.group(0)), value)
    return value
