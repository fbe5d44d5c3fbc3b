"""``draftheads.storage``: the free-space check every large write runs first, and file modes."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest

from draftheads.storage import (
    InsufficientSpaceError,
    apply_default_mode,
    check_free_space,
    current_umask,
    format_bytes,
)

Usage = namedtuple("Usage", "total used free")


def fake_disk(monkeypatch, free: int) -> list:
    """shutil.disk_usage reporting ``free`` bytes; returns the paths it was asked about."""
    asked: list = []

    def disk_usage(path):
        asked.append(path)
        return Usage(10 * free + 1, 9 * free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return asked


@pytest.mark.parametrize(
    "count, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"), (3 * 2**30 // 2, "1.5 GiB")],
)
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def test_enough_space_passes(monkeypatch, tmp_path):
    fake_disk(monkeypatch, free=2**30)
    check_free_space(tmp_path, 2**30, "a head")  # exactly enough is enough


def test_too_little_space_names_directory_sizes_and_what(monkeypatch, tmp_path):
    fake_disk(monkeypatch, free=100 * 2**20)
    with pytest.raises(InsufficientSpaceError) as caught:
        check_free_space(tmp_path / "out", 3 * 2**30, "the medusa export")
    err = caught.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err) == (
        f"not enough free space in {tmp_path / 'out'} for the medusa export: needs 3.0 GiB, "
        "100.0 MiB free; free some space or write elsewhere"
    )


def test_a_directory_not_yet_created_is_measured_at_its_nearest_parent(monkeypatch, tmp_path):
    asked = fake_disk(monkeypatch, free=2**40)
    check_free_space(tmp_path / "a" / "b" / "c", 1, "x")
    assert asked == [tmp_path]


def test_negative_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needed_bytes must be >= 0, got -1"):
        check_free_space(tmp_path, -1, "x")


def test_default_mode_follows_the_umask(tmp_path):
    path = tmp_path / "weights"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)  # what a private temporary file is created with
    previous = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        apply_default_mode(path)
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o640
