"""What a ``draftheads distill --out`` file's answers were made with, recorded beside it.

A distill output resumes by conversation id: a re-run skips every id already written. That is
sound only when the re-run would write the same kind of answers, so the settings the answers depend
on (the base, the source and its content, the split, sampling and length settings, the dtype) are
written to ``<out>.settings.json`` before the first record, and a run whose settings differ is
refused, naming the field and both values, before anything is loaded or written. An output
written before its settings were recorded resumes unchecked: its answers' settings are unknown,
so none are claimed for it. The corpus mode keeps the same settings in its manifest
(``draftheads.data.corpus``).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from draftheads.data.sources import DataError
from draftheads.storage import write_text_atomically

SETTINGS_SUFFIX = ".settings.json"


class SettingsMismatchError(DataError, FileExistsError):
    """An existing output was made under other settings: continuing it is refused."""


@dataclass(frozen=True)
class DistillSettings:
    """What the answers in one distill output share."""

    base: str  # as named: alias, Hub id, directory or .gguf
    source: str  # --data or --prompts as given (a dataset may carry "@revision")
    source_sha256: str | None  # of the local file or directory read (None for a Hub dataset)
    split: str | None  # for a dataset source; None for files, which have no splits
    temperature: float
    max_new_tokens: int
    max_length: int | None
    dtype: str  # as decoded: greedy answers differ between float32 and bfloat16
    seed: int | None  # the sampling seed; None when greedy (the answers do not depend on it)
    # --template as given (auto | chat | plain; with the base fixed, auto always resolves alike).
    # Fields added after the first ones carry a default that describes every output written before
    # them: those runs required a chat template and used it, which is what auto resolves to there.
    template: str = "auto"


def settings_path(out: Path) -> Path:
    """Where the settings of the output ``out`` are kept."""
    return out.with_name(out.name + SETTINGS_SUFFIX)


def read_settings(path: Path) -> dict | None:
    """The recorded settings as a dict, None when there is no such file; a DataError names a file
    that is not a settings object."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        recorded = json.loads(text)
    except ValueError as error:
        raise DataError(f"{path}: not JSON ({error}); remove it to resume unchecked") from None
    if not isinstance(recorded, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(recorded).__name__}")
    return recorded


def write_settings(path: Path, settings: DistillSettings) -> None:
    """Write ``settings`` atomically: a crash leaves no file or the whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(asdict(settings), indent=2) + "\n")


def check_or_record(out: Path, settings: DistillSettings, has_records: bool) -> str | None:
    """Check ``settings`` against those recorded for ``out``, or record them for a new output.

    Returns a note to print when ``out`` holds records but no settings (written before they were
    recorded: it resumes unchecked), else None. Raises ``SettingsMismatchError`` naming the first
    field whose recorded value differs from this run's.
    """
    path = settings_path(out)
    if not has_records:  # a new output, or one whose records were removed: its settings are this run's
        write_settings(path, settings)
        return None
    recorded = read_settings(path)
    if recorded is None:
        return f"{out} records no settings (written before distill recorded them): resuming it unchecked"
    for field in fields(DistillSettings):
        value = getattr(settings, field.name)
        before_value = recorded.get(field.name, field.default)  # a later field: its default
        if before_value is MISSING or before_value != value:
            before = repr(recorded[field.name]) if field.name in recorded else "absent"
            raise SettingsMismatchError(
                f"{out}: field '{field.name}' is {before} in {path.name}, this run's {value!r}; "
                "a run made otherwise would mix its answers in: give another --out"
            )
    return None
