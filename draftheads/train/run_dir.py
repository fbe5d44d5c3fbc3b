"""Which directories ``draftheads train`` may write into: new or empty ones, and its own runs.

A run claims its output directory by writing the run marker (``draftheads-run.json``) as soon as
it holds the directory's lock; a later run into the same directory recognises it by that file, and
a run made before the marker existed by the files only a run writes (``checkpoints/``,
``metrics.jsonl``, ``head/`` ...). Any other directory that is not empty is refused before a model
loads, naming what it holds: training there would replace the user's files (their ``config.json``
by the run config). A saved head's directory is always refused: the run config would replace the
head's config.json, and the head would no longer load. A finished run (a saved ``head/`` and no
checkpoint left to resume) is trained again only with ``overwrite``, which replaces its head's
files, metrics.jsonl and config.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftheads.heads.base import CONFIG_NAME, RUN_HEAD_DIR, WEIGHT_SUFFIXES
from draftheads.settings import ConfigError
from draftheads.storage import write_text_atomically
from draftheads.train.checkpoint import CHECKPOINTS_DIR, list_checkpoints
from draftheads.train.lock import LOCK_NAME
from draftheads.train.reporting import CURVES_NAME, METRICS_NAME

MARKER_NAME = "draftheads-run.json"
MARKER_FORMAT = "draftheads-run"
DATA_REPORT_NAME = "data_report.json"
# What only a training run writes: how a run from before the marker is recognised. (Its top-level
# config.json is not among them: a directory holding the user's own config.json looks the same.)
RUN_ENTRIES = (
    MARKER_NAME,
    CHECKPOINTS_DIR,
    METRICS_NAME,
    RUN_HEAD_DIR,
    LOCK_NAME,
    DATA_REPORT_NAME,
    CURVES_NAME,
)
LISTED_ENTRIES = 5  # a refusal names this many of a directory's entries


class OutputDirRefusedError(FileExistsError):
    """``train.output_dir`` holds what a run must not replace: the user's files, a saved head, or a
    finished run (without ``overwrite``)."""


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED_ENTRIES])
    return shown + (f" and {len(names) - LISTED_ENTRIES} more" if len(names) > LISTED_ENTRIES else "")


def is_head_dir(directory: Path) -> bool:
    """Does ``directory`` hold a saved head: weights at its top, or a head's config.json?"""
    if any(path.is_file() and path.name.endswith(WEIGHT_SUFFIXES) for path in directory.iterdir()):
        return True
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "head_kind" in config


def is_run_dir(directory: Path) -> bool:
    """Is ``directory`` a training run's output directory (with or without the run marker)?"""
    return any((directory / name).exists() for name in RUN_ENTRIES)


def check_output_dir(directory: Path, resume: bool, overwrite: bool) -> None:
    """Refuse ``directory`` as ``train.output_dir`` unless it is missing, empty, or a run of ours
    that this run may go on with (``resume``) or replace (``overwrite``); reads only."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise OutputDirRefusedError(f"train.output_dir {directory} is a file; give a directory")
    names = sorted(path.name for path in directory.iterdir())
    if not names:
        return
    if is_head_dir(directory):
        raise OutputDirRefusedError(
            f"train.output_dir {directory} holds a saved head ({_listing(names)}), not a training run; "
            f"training there would replace its {CONFIG_NAME}; choose another train.output_dir "
            f"(train.init_head={directory} starts from its weights)"
        )
    if not is_run_dir(directory):
        raise OutputDirRefusedError(
            f"train.output_dir {directory} is not empty and is not a draftheads training run (it holds "
            f"{_listing(names)}); choose a new or empty directory"
        )
    has_checkpoints = bool(list_checkpoints(directory))
    if has_checkpoints and not resume:
        raise ConfigError(
            f"train.output_dir {directory} already holds checkpoints; set train.resume=true to continue "
            "that run, or choose another train.output_dir"
        )
    if not has_checkpoints and (directory / RUN_HEAD_DIR / CONFIG_NAME).is_file() and not overwrite:
        raise OutputDirRefusedError(
            f"train.output_dir {directory} holds a finished run (its head in {directory / RUN_HEAD_DIR}, "
            f"no checkpoint to resume from); pass --overwrite (overwrite=True) to train it again, "
            f"replacing its head, {METRICS_NAME} and {CONFIG_NAME}, or choose another train.output_dir"
        )


def claim_output_dir(directory: Path) -> None:
    """Mark ``directory`` (locked by this run) as a training run's, once: written whole or not at all."""
    marker = directory / MARKER_NAME
    if marker.is_file():
        return
    record = {"format": MARKER_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_text_atomically(marker, json.dumps(record) + "\n")
