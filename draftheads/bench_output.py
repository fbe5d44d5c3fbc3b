"""Where ``draftheads bench`` writes its results, never over a file it did not write.

A bench run takes minutes to hours, and its ``--out`` can change meanwhile (a second run started on
the same directory, a user copying results in). So a run claims ``bench.json`` when it starts
(created exclusively, or replacing an earlier run's with ``--overwrite``), rewrites ``bench.json``
and ``bench.md`` whole (a temporary file renamed over them) after every batch with
``"partial": true`` until the last, so an interrupted run keeps what it measured, and before every
write checks that each file is still the one it last wrote. If something else replaced one, the
run writes ``bench-<unique>.json`` / ``.md`` from then on, says so, and leaves the other alone.

Every file a run writes is listed in the directory's ``bench-outputs.json``, so a later run replaces
(its charts) or removes (a chart of batch sizes it did not measure) only files a bench run wrote: a
chart of the same name it did not write is refused (``OutputExistsError``), before the run where
``check_charts`` sees it, else when the chart would be written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from draftheads.storage import write_atomically, write_text_atomically

RESULT_STEM = "bench"
RESULT_FILES = (f"{RESULT_STEM}.json", f"{RESULT_STEM}.md")  # what a run writes besides its charts
SPEEDUP_CHART = "speedup_by_category.png"
ACCEPTANCE_CHART = "acceptance_by_depth.png"
BATCH_CHART = "throughput_by_batch.png"
CHART_FILES = (SPEEDUP_CHART, ACCEPTANCE_CHART, BATCH_CHART)  # every chart a run may write
SUFFIXES = (".json", ".md")
OUTPUTS_NAME = "bench-outputs.json"  # the files bench runs wrote in the directory
OUTPUTS_KIND = "draftheads bench"  # its "written_by": what marks the list as ours


class OutputExistsError(FileExistsError):
    """A file bench would write exists and no bench run wrote it; names it."""


def listed_outputs(out: Path) -> set[str]:
    """The files bench runs wrote in ``out`` (its ``bench-outputs.json``; none without one). A list
    that is not ours raises OutputExistsError: bench would have to replace it."""
    path = Path(out) / OUTPUTS_NAME
    if not os.path.lexists(path):
        return set()
    try:
        listed = json.loads(path.read_text())
        if listed["written_by"] != OUTPUTS_KIND or not isinstance(listed["files"], list):
            raise ValueError(f"'written_by' must be {OUTPUTS_KIND!r} and 'files' a list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise OutputExistsError(
            f"{path}: not a list of bench's outputs ({err}); move it or choose another --out"
        )
    return {str(name) for name in listed["files"]}


def record_outputs(out: Path, added: Iterable[str] = (), removed: Iterable[str] = ()) -> None:
    """Add and remove names in ``out``'s list of bench's outputs (read again first: another run in
    the same directory may have added its own)."""
    names = (listed_outputs(out) | set(added)) - set(removed)
    record = {"written_by": OUTPUTS_KIND, "files": sorted(names)}
    write_text_atomically(Path(out) / OUTPUTS_NAME, json.dumps(record, indent=2) + "\n")


def check_charts(out: Path) -> None:
    """Refuse, before a run, an ``out`` holding a chart under a name the run writes that no bench
    run wrote (a user's own ``speedup_by_category.png``, say)."""
    listed = listed_outputs(out)
    for name in CHART_FILES:
        path = Path(out) / name
        if os.path.lexists(path) and name not in listed:
            raise OutputExistsError(
                f"--out {out}: {path} was not written by bench (not in {OUTPUTS_NAME}) and a run would "
                "replace it; move it or choose another --out"
            )


def file_signature(path: Path) -> tuple[int, int, int, int] | None:
    """What tells one version of a file from another (None: no file)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


class ResultFiles:
    """This run's bench.json and bench.md in ``out`` (or its ``bench-<unique>`` pair once diverted)."""

    def __init__(self, out: Path, notify: Callable[[str], None] = _warn):
        self.out = Path(out)
        self.stem = RESULT_STEM
        self.notify = notify
        self._written: dict[str, tuple | None] = {}  # file name -> its signature after our last write

    def path(self, suffix: str) -> Path:
        return self.out / f"{self.stem}{suffix}"

    @property
    def chart_prefix(self) -> str:
        """Prefix of this run's chart names: none, or the diverted results' stem."""
        return "" if self.stem == RESULT_STEM else f"{self.stem}-"

    def claim(self, overwrite: bool, json_text: str, md_text: str) -> list[Path]:
        """Write the first (partial) results; ``overwrite``: replacing an earlier run's results in
        ``out`` (their bench.json / bench.md), else only files that do not exist yet."""
        if overwrite:
            for name in RESULT_FILES:
                self._written[name] = file_signature(self.out / name)
        return self.write(json_text, md_text)

    def write(self, json_text: str, md_text: str) -> list[Path]:
        """Write both files whole; divert first if either is no longer the one this run wrote (or
        one this run was to create appeared meanwhile)."""
        while True:
            replaced = [self.path(s).name for s in SUFFIXES if not self._ours(self.path(s))]
            if replaced:
                self._divert(replaced)
            if all(self._put(suffix, text) for suffix, text in zip(SUFFIXES, (json_text, md_text))):
                return [self.path(suffix) for suffix in SUFFIXES]

    def save_chart(self, name: str, write: Callable[[Path], None]) -> Path:
        """Write chart ``name`` (under this run's prefix) with ``write(path)``, replacing only a file
        a bench run wrote (else OutputExistsError); returns its path."""
        path = self.out / f"{self.chart_prefix}{name}"
        if os.path.lexists(path) and path.name not in listed_outputs(self.out):
            raise OutputExistsError(
                f"{path} was not written by bench (not in {OUTPUTS_NAME}); the results are in "
                f"{self.path('.json')}; move it and run again for the chart"
            )
        write_atomically(path, write)
        record_outputs(self.out, added=[path.name])
        return path

    def remove_stale_charts(self, written: Iterable[Path]) -> list[Path]:
        """Delete the charts an earlier run wrote under this run's names that this run did not
        write again (an ``--overwrite`` run with other batch sizes), those a bench run's list
        names only; returns them."""
        kept, listed = {Path(p).name for p in written}, listed_outputs(self.out)
        stale = [self.out / f"{self.chart_prefix}{name}" for name in CHART_FILES]
        stale = [path for path in stale if path.name not in kept and path.name in listed and path.is_file()]
        for path in stale:
            path.unlink()
        record_outputs(self.out, removed=[path.name for path in stale])
        return stale

    def _ours(self, path: Path) -> bool:
        """The file is as this run left it (absent, when this run has not written it)."""
        return file_signature(path) == self._written.get(path.name)

    def _divert(self, replaced: list[str]) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        unique = f"{RESULT_STEM}-{stamp}-{os.getpid()}"
        copies = 1
        while any((self.out / f"{unique}{s}").exists() for s in SUFFIXES):
            copies += 1
            unique = f"{RESULT_STEM}-{stamp}-{os.getpid()}-{copies}"
        self.notify(
            f"draftheads bench: {', '.join(replaced)} in {self.out} changed during the run (not by it); "
            f"this run's results go to {unique}.json and {unique}.md instead"
        )
        self.stem = unique

    def _put(self, suffix: str, text: str) -> bool:
        """Write one file; False (nothing written) when it is to be created and one appeared."""
        path = self.path(suffix)
        if self._written.get(path.name) is None:  # first write: create it, refusing one there now
            try:
                handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(handle, "w") as file:
                file.write(text)
        else:
            write_text_atomically(path, text)
        self._written[path.name] = file_signature(path)
        if path.name not in listed_outputs(self.out):
            record_outputs(self.out, added=[path.name])
        return True
