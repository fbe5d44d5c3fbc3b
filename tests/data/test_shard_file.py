"""Row reads from a safetensors file with pread: the values safetensors reads; damaged files named."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftheads.data.shard_file import MissingTensorError, ShardFile, ShardFileError


@pytest.fixture
def shard(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "hidden_states.2": torch.randn(37, 5, generator=generator).to(torch.bfloat16),
        "hidden_states.9": torch.randn(37, 5, generator=generator),
        "offsets": torch.tensor([0, 11, 30, 37], dtype=torch.int64),
        "input_ids": torch.randint(0, 1000, (37,), generator=generator, dtype=torch.int32),
        "mask": torch.rand(37, 2, 3, generator=generator) > 0.5,
    }
    path = tmp_path / "shard-00000.safetensors"
    save_file(tensors, str(path), metadata={"written_by": "test"})
    return path, tensors


def test_rows_equal_what_safetensors_reads(shard):
    path, tensors = shard
    with ShardFile(path) as reader, safe_open(str(path), framework="pt") as reference:
        assert sorted(reader.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert reader.shape(name) == list(tensor.shape)
            length = tensor.shape[0]
            for start, stop in [(0, length), (1, length - 1), (length - 1, length), (2, 2)]:
                rows = reader.rows(name, start, stop)
                assert rows.dtype == tensor.dtype
                assert torch.equal(rows, tensor[start:stop])
                assert torch.equal(rows, reference.get_slice(name)[start:stop])


def test_rows_are_a_tensor_of_their_own(shard):
    path, tensors = shard
    with ShardFile(path) as reader:
        rows = reader.rows("hidden_states.9", 2, 4)
        rows += 1  # writable, and not the file's
        assert torch.equal(reader.rows("hidden_states.9", 2, 4), tensors["hidden_states.9"][2:4])


def test_a_missing_tensor_or_rows_past_the_end_are_named(shard):
    path, _ = shard
    with ShardFile(path) as reader:
        assert "offsets" in reader and "base_argmax" not in reader
        where = re.escape(str(path))
        with pytest.raises(
            MissingTensorError, match=f"{where}: no tensor 'base_argmax' \\(it holds .*offsets"
        ):
            reader.rows("base_argmax", 0, 1)
        with pytest.raises(IndexError, match=f"{where}: rows 30-38 of tensor 'input_ids', which has 37"):
            reader.rows("input_ids", 30, 38)
    with pytest.raises(ValueError, match="read after close"):
        reader.rows("input_ids", 0, 1)


def _write(path, header: dict, data: bytes = b"", length: int | None = None):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)
    return path


def _named(path) -> str:
    return re.escape(str(path))


def test_damaged_files_are_named(shard, tmp_path):
    path, _ = shard
    whole = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole[: len(whole) - 8])  # the last tensor's bytes cut short
    with pytest.raises(ShardFileError, match=f"{_named(cut)}: tensor .* does not fit"):
        ShardFile(cut)
    short = tmp_path / "short.safetensors"
    short.write_bytes(whole[:5])
    with pytest.raises(ShardFileError, match=f"{_named(short)}: 5 bytes, shorter than a safetensors header"):
        ShardFile(short)
    too_long = _write(tmp_path / "long.safetensors", {}, length=10**6)
    with pytest.raises(ShardFileError, match="header length 1000000 does not fit"):
        ShardFile(too_long)
    not_json = tmp_path / "text.safetensors"
    not_json.write_bytes(struct.pack("<Q", 4) + b"{abc")
    with pytest.raises(ShardFileError, match=f"{_named(not_json)}: header is not JSON"):
        ShardFile(not_json)
    a_list = _write(tmp_path / "list.safetensors", [])  # type: ignore[arg-type]
    with pytest.raises(ShardFileError, match="header is a JSON list, not an object"):
        ShardFile(a_list)
    unknown = _write(
        tmp_path / "dtype.safetensors", {"x": {"dtype": "F8_E9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"
    )
    with pytest.raises(ShardFileError, match="tensor 'x' has an unreadable entry"):
        ShardFile(unknown)
    wrong_size = _write(
        tmp_path / "size.safetensors", {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)
    )
    with pytest.raises(
        ShardFileError, match=r"tensor 'x' \(F32 \[3\]\) at bytes 0-8 does not fit a shape with rows"
    ):
        ShardFile(wrong_size)
    for name, entry, data in [
        ("scalar", {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, bytes(4)),  # no rows to read
        ("before", {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, b""),  # would read the header
        ("negative", {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]}, bytes(16)),
    ]:
        bad = _write(tmp_path / f"{name}.safetensors", {"x": entry}, data)
        with pytest.raises(
            ShardFileError, match=f"{_named(bad)}: tensor 'x' .* does not fit a shape with rows"
        ):
            ShardFile(bad)
