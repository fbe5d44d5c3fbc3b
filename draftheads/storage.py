"""Disk hygiene for everything draftheads writes: free space checked before a large write, files
given the permissions the user's umask asks for, and writes that replace a file whole
(``write_atomically``), never through a symbolic link left where the file goes.

``check_free_space`` runs before writing, so a full disk is reported up front in one sentence
(where, how much is needed, how much is free, what was being written) instead of as a half-written
file. ``InsufficientSpaceError`` is an ``OSError`` with ``errno.ENOSPC``, the error the write itself
would have raised.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class InsufficientSpaceError(OSError):
    """Not enough free space for a write; the message names the directory, the bytes needed and
    free, and what was being written. Raised as ``InsufficientSpaceError(errno.ENOSPC, message)``."""

    def __str__(self) -> str:
        return str(self.strerror)  # the sentence alone, without OSError's "[Errno 28]" prefix


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, as hex (checkpoint and corpus manifests record it)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def format_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, one decimal; plain bytes below 1 KiB)."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _existing_ancestor(directory: Path) -> Path:
    """``directory`` or its nearest existing parent: where the bytes will land before it exists."""
    path = directory.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(directory: str | Path, needed_bytes: int, what: str) -> None:
    """Raise InsufficientSpaceError if the filesystem holding ``directory`` (or, before it exists,
    its nearest existing parent) has fewer than ``needed_bytes`` free for this user.

    Args:
        directory: where the write will go.
        needed_bytes: the estimated size of the write, margin included.
        what: what is being written, for the message (e.g. ``"the medusa export"``).
    """
    if needed_bytes < 0:
        raise ValueError(f"needed_bytes must be >= 0, got {needed_bytes}")
    free = shutil.disk_usage(_existing_ancestor(Path(directory))).free
    if free < needed_bytes:
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"not enough free space in {directory} for {what}: needs {format_bytes(needed_bytes)}, "
            f"{format_bytes(free)} free; free some space or write elsewhere",
        )


def current_umask() -> int:
    """The process umask (``os.umask`` can only be read by setting it, so it is set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_default_mode(path: str | Path) -> None:
    """Give a file written through a private temporary file (mode 0600, as safetensors' ``save_file``
    leaves it) the mode a plain ``open()`` would have: 0666 less the umask."""
    os.chmod(path, 0o666 & ~current_umask())


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Replace ``path`` with the file ``write(temporary)`` writes, so that a reader sees the old file
    or the whole new one, and a symbolic link at ``path`` is replaced, never written through (the
    file it points to is left as it was). The temporary file is created exclusively beside ``path``
    (same filesystem, same suffix, so writers that read the format from it work), removed on
    failure, given a plain file's mode and renamed over ``path``. An OSError of the write (a full
    disk) is raised naming ``path``, not the temporary file, which the user never asked for."""
    path = Path(path)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.tmp-", suffix=path.suffix)
    os.close(handle)
    temporary = Path(name)
    try:
        try:
            write(temporary)
        except OSError as err:
            if not err.errno or err.filename not in (None, name, temporary):
                raise
            raise OSError(err.errno, err.strerror or os.strerror(err.errno), str(path)) from err
        apply_default_mode(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8), as ``write_atomically`` does."""
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
