"""Random row reads from a safetensors file, with no read-ahead.

A feature-cache shard is a safetensors file (https://github.com/huggingface/safetensors, "Format"):
an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range in the data that follows, then the data. Training reads a few rows of a shard at a time, in
random order over tens of gigabytes. Read through safetensors' memory map, every page fault pulls
in the device's read-ahead (often megabytes), so a row of a few hundred KiB costs many times its
bytes in disk reads once the cache no longer fits in memory (docs/training.md, "Feature caches",
caches larger than memory). ``ShardFile`` reads the rows'
bytes alone with ``preadv``, straight into the tensor it returns, on a descriptor advised
``POSIX_FADV_RANDOM`` (Linux: no read-ahead; macOS has no such advice and keeps its own). The data
is little-endian, as safetensors writes it and as x86 and ARM hosts read it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Self

import torch

HEADER_LENGTH_BYTES = 8  # the little-endian uint64 in front of the JSON header
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on the header
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read from ``offset`` into ``view``: ``preadv`` where the OS has it (Linux, macOS 11+)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], offset)
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


class ShardFileError(ValueError):
    """A file that is not a readable safetensors file: ``path`` and what is wrong with it."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


class MissingTensorError(LookupError):
    """A tensor the file does not hold."""


class ShardFile:
    """One safetensors file open for reads of rows (slices of the first dimension) of its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # Linux; elsewhere the OS's default read-ahead stays
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._size = os.fstat(self._fd).st_size
            self._entries, self._data_start = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> tuple[dict[str, dict], int]:
        prefix = os.pread(self._fd, HEADER_LENGTH_BYTES, 0)
        if len(prefix) < HEADER_LENGTH_BYTES:
            raise ShardFileError(self.path, f"{self._size} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, self._size - HEADER_LENGTH_BYTES):
            raise ShardFileError(
                self.path, f"header length {length} does not fit the file's {self._size} bytes"
            )
        try:
            header = json.loads(os.pread(self._fd, length, HEADER_LENGTH_BYTES))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ShardFileError(self.path, f"header is not JSON ({err})") from err
        if not isinstance(header, dict):
            raise ShardFileError(self.path, f"header is a JSON {type(header).__name__}, not an object")
        data_start = HEADER_LENGTH_BYTES + length
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = [int(dim) for dim in entry["shape"]]
                begin, end = (int(offset) for offset in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise ShardFileError(self.path, f"tensor {name!r} has an unreadable entry {entry!r}") from err
            if (
                not shape
                or min(shape) < 0
                or not 0 <= begin <= end
                or end - begin != math.prod(shape) * dtype.itemsize
                or data_start + end > self._size
            ):
                raise ShardFileError(
                    self.path,
                    f"tensor {name!r} ({entry['dtype']} {shape}) at bytes {begin}-{end} does not fit "
                    f"a shape with rows or the file's {self._size} bytes",
                )
            entries[name] = {"dtype": dtype, "shape": shape, "begin": begin}
        return entries, data_start

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        if name not in self._entries:
            raise MissingTensorError(f"{self.path}: no tensor {name!r} (it holds {', '.join(self._entries)})")
        return self._entries[name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name``: a new tensor of shape (stop - start, *rest)."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: read after close")
        entry = self._entry(name)
        length, *rest = entry["shape"]
        if not 0 <= start <= stop <= length:
            raise IndexError(f"{self.path}: rows {start}-{stop} of tensor {name!r}, which has {length}")
        row_bytes = entry["dtype"].itemsize * math.prod(rest)
        out = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        offset = self._data_start + entry["begin"] + start * row_bytes
        done = 0
        while done < len(view):  # a read may return fewer bytes than asked
            read = _read_into(self._fd, view[done:], offset + done)
            if read == 0:
                raise ShardFileError(self.path, f"ends before tensor {name!r}'s rows {start}-{stop}")
            done += read
        return out.view(entry["dtype"]).view(stop - start, *rest)

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:  # also when __init__ failed before opening
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
