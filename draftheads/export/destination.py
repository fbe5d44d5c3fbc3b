"""Where an export goes: the manifest every export writes, the checks that let ``--overwrite``
replace a previous export and nothing else, and the staging directory renamed into place.

An export is written into a staging directory next to ``--out`` and renamed onto it only once
complete, so a failure (a full disk, an exception half way) leaves any previous export as it was
and no half-written directory behind. ``--overwrite`` replaces only a directory whose manifest
lists every file in it: never the head being exported, a directory holding it, the current
directory or one of its parents, or a directory of other files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftheads.heads.base import CONFIG_NAME
from draftheads.storage import current_umask

MANIFEST_NAME = "draftheads-export.json"
MANIFEST_KIND = "draftheads export"  # the manifest's "written_by": what marks a directory as ours
_SHOWN_NAMES = 5  # how many of a directory's entries an error lists


class DestinationError(FileExistsError):
    """``--out`` cannot be written or replaced; says why and what to do instead."""


def _listing(names: set[str]) -> str:
    shown = sorted(names)[:_SHOWN_NAMES]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def read_manifest(directory: Path) -> list[str] | None:
    """The files a previous export in ``directory`` wrote (relative paths), or None if it has no
    manifest."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DestinationError(f"{path}: not valid JSON ({err}); delete the directory yourself") from err
    if not isinstance(manifest, dict) or manifest.get("written_by") != MANIFEST_KIND:
        manifest = {}
    files = manifest.get("files")
    if not isinstance(files, list):
        raise DestinationError(
            f"{path}: field 'written_by' must be {MANIFEST_KIND!r} and 'files' a list; "
            "delete the directory yourself"
        )
    return [str(name) for name in files]


def write_manifest(directory: Path, format_name: str, head_kind: str) -> list[str]:
    """List every file under ``directory`` in its manifest (written last); returns that list."""
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir())
    manifest = {
        "written_by": MANIFEST_KIND,
        "export_format": format_name,
        "head_kind": head_kind,
        "files": files,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return files


def _unlisted_entries(directory: Path, listed: list[str]) -> set[str]:
    """Entries under ``directory`` that neither the manifest lists nor hold a listed file."""
    allowed = {MANIFEST_NAME}
    for name in listed:
        allowed.add(name)
        allowed.update(str(parent) for parent in Path(name).parents if str(parent) != ".")
    return {str(p.relative_to(directory)) for p in directory.rglob("*")} - allowed


def check_destination(out_dir: Path, head_dir: Path, overwrite: bool) -> None:
    """Raise DestinationError unless an export may be written to ``out_dir``: it does not exist,
    is empty, or (with ``overwrite``) holds a previous export and nothing else. ``out_dir`` may
    never be, or hold, ``head_dir`` or the current directory."""
    target, head, cwd = out_dir.resolve(), head_dir.resolve(), Path.cwd().resolve()
    if target == head or target in head.parents:
        raise DestinationError(
            f"--out {out_dir} holds the head being exported ({head_dir}); choose a directory outside it"
        )
    if target == cwd or target in cwd.parents:
        raise DestinationError(
            f"--out {out_dir} is the current directory or one of its parents; "
            "export into a new directory (e.g. --out exports/<name>)"
        )
    if out_dir.is_symlink():
        raise DestinationError(f"--out {out_dir} is a symbolic link; give the directory it points to")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise DestinationError(f"--out {out_dir} exists and is not a directory")
    entries = {p.name for p in out_dir.iterdir()}
    if not entries:
        return
    listed = read_manifest(out_dir)
    if listed is None and CONFIG_NAME in entries:
        raise DestinationError(
            f"--out {out_dir} holds an export without a {MANIFEST_NAME} manifest (from an earlier "
            "draftheads), which --overwrite does not replace: check it holds nothing of yours, "
            f"then delete it yourself (rm -r {out_dir}), or choose another --out"
        )
    if listed is None:
        raise DestinationError(
            f"--out {out_dir} is not empty and is not a draftheads export (it holds {_listing(entries)}); "
            "choose another --out (--overwrite replaces only a previous export)"
        )
    if not overwrite:
        raise DestinationError(f"--out {out_dir} holds a previous export; pass --overwrite to replace it")
    unlisted = _unlisted_entries(out_dir, listed)
    if unlisted:
        raise DestinationError(
            f"--out {out_dir} holds files its export did not write ({_listing(unlisted)}); "
            "move them out or choose another --out"
        )


def _publish(staging: Path, out_dir: Path) -> None:
    """Rename the finished ``staging`` onto ``out_dir`` (absent, empty, or a checked previous
    export); if the second rename fails, the previous export is put back."""
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp creates it 0700
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    # rename(2) replaces an empty directory: retire the old export under a fresh name first.
    retired = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.replaced-"))
    os.rename(out_dir, retired)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        os.rename(retired, out_dir)
        raise
    shutil.rmtree(retired, ignore_errors=True)


@contextmanager
def staged_export(out_dir: Path, head_dir: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh staging directory next to ``out_dir`` to write the export into; on a clean exit it
    replaces ``out_dir`` (checked again, in case it changed meanwhile), on an error it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.staging-"))
    try:
        yield staging
        check_destination(out_dir, head_dir, overwrite)
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
