"""Where ``draftheads bench`` writes its results, never over a file it did not write.

A bench run takes minutes to hours, and its ``--out`` can change meanwhile (a second run started on
the same directory, a user copying results in). So a run claims ``bench.json`` when it starts
(created exclusively, or replacing an earlier run's with ``--overwrite``), rewrites ``bench.json``
and ``bench.md`` whole (a temporary file renamed over them) after every batch with
``"partial": true`` until the last, so an interrupted run keeps what it measured, and before every
write checks that each file is still the one it last wrote. If something else replaced one, the
run writes ``bench-<unique>.json`` / ``.md`` from then on, says so, and leaves the other alone.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from draftheads.storage import write_text_atomically

RESULT_STEM = "bench"
RESULT_FILES = (f"{RESULT_STEM}.json", f"{RESULT_STEM}.md")  # what a run writes besides its charts
SPEEDUP_CHART = "speedup_by_category.png"
ACCEPTANCE_CHART = "acceptance_by_depth.png"
BATCH_CHART = "throughput_by_batch.png"
CHART_FILES = (SPEEDUP_CHART, ACCEPTANCE_CHART, BATCH_CHART)  # every chart a run may write
SUFFIXES = (".json", ".md")


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

    def remove_stale_charts(self, written: Iterable[Path]) -> list[Path]:
        """Delete the charts an earlier run wrote under this run's names that this run did not
        write again (an ``--overwrite`` run with other batch sizes); returns them."""
        kept = {Path(p).name for p in written}
        stale = [self.out / f"{self.chart_prefix}{name}" for name in CHART_FILES]
        stale = [path for path in stale if path.name not in kept and path.is_file()]
        for path in stale:
            path.unlink()
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
        return True
