"""An exclusive lock on a run's output directory, held for the whole run.

Two runs writing one output directory at once corrupt it (interleaved ``metrics.jsonl``, one run's
``config.json`` beside the other's head, checkpoints pruned under each other). ``flock(2)`` on
``<output_dir>/train.lock`` keeps the second run out; the file holds the holder's pid, host and
start time so the refusal can name them. The kernel drops the lock when its process dies (also on
SIGKILL), so a crashed run never blocks the next one; a lock file still naming its holder when we
acquire it tells us that holder did not finish cleanly, and we say so. ``flock`` covers processes
on one machine and, on Linux >= 2.6.12, NFS clients (where it is emulated with byte-range locks).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from draftheads.settings import ConfigError

LOCK_NAME = "train.lock"


class OutputDirLockedError(ConfigError):
    """Another live process holds the output directory's lock."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a lock: read from, and written to, the lock file."""

    pid: int
    host: str
    started: str  # ISO 8601, UTC

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


def current_holder() -> LockHolder:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return LockHolder(pid=os.getpid(), host=socket.gethostname(), started=started)


def read_holder(text: str) -> LockHolder | None:
    """The holder recorded in a lock file's text; None for an empty or unreadable file."""
    try:
        record = json.loads(text)
        return LockHolder(pid=int(record["pid"]), host=str(record["host"]), started=str(record["started"]))
    except (ValueError, KeyError, TypeError):
        return None


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


class OutputLock:
    """The held lock; ``release()`` (or leaving a ``with`` block) frees it."""

    def __init__(self, path: Path, descriptor: int):
        self.path = path
        self._descriptor: int | None = descriptor

    @classmethod
    def acquire(cls, directory: str | Path) -> OutputLock:
        """Lock ``directory`` (created if missing) or raise OutputDirLockedError naming the holder.

        A lock file that still names a previous holder (it crashed or was killed before
        releasing) is taken over with a warning naming it.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(path.read_text())
            os.close(descriptor)
            who = holder.describe() if holder else "a process that has not yet written its pid"
            raise OutputDirLockedError(
                f"train.output_dir {directory} is in use by another run ({who}; lock file {path}); "
                "wait for it to finish or choose another train.output_dir"
            ) from None
        except BaseException:
            os.close(descriptor)
            raise
        previous = read_holder(os.pread(descriptor, 4096, 0).decode(errors="replace"))
        if previous is not None:
            if previous.host != socket.gethostname():
                state = "it no longer holds the lock"
            elif previous.pid == os.getpid():
                state = "this process dropped it without releasing it"
            elif _is_running(previous.pid):
                state = "it no longer holds the lock (that pid now belongs to another process)"
            else:
                state = "that process is no longer running"
            warnings.warn(
                f"{path}: taking over a stale lock left by {previous.describe()}; {state}, so that "
                "run ended without releasing it (crashed or killed)",
                stacklevel=2,
            )
        record = json.dumps(current_holder().__dict__) + "\n"
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, record.encode(), 0)
        os.fsync(descriptor)
        return cls(path, descriptor)

    def release(self) -> None:
        """Empty the lock file (a clean end leaves no holder behind) and unlock; idempotent.
        The file itself stays: deleting it would let a waiting process lock an unlinked inode."""
        if self._descriptor is None:
            return
        descriptor, self._descriptor = self._descriptor, None
        try:
            os.ftruncate(descriptor, 0)
        finally:
            os.close(descriptor)  # closing the last descriptor drops the flock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
