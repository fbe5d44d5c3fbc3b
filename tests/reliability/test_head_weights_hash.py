"""A head's config.json records the sha256 of its weights, and loading checks it: flipped bytes in
model.safetensors (which would still load and draft, losslessly but with fewer accepted tokens)
are refused with one line naming the file; heads saved before the hash existed still load."""

from __future__ import annotations

import json

import pytest

from draftheads.cli import main
from draftheads.heads import build_head, load_head
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError
from draftheads.heads.medusa import MedusaConfig
from draftheads.shipped import SHIPPED_HEADS, shipped_head_dir
from draftheads.storage import file_sha256


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


def _flip_a_weight_byte(head_dir):
    path = head_dir / WEIGHTS_NAME
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last tensor's data: the file still parses
    path.write_bytes(bytes(data))


def test_a_saved_head_records_the_sha256_of_its_weights(head_dir):
    config = json.loads((head_dir / CONFIG_NAME).read_text())
    assert config["weights_sha256"] == file_sha256(head_dir / WEIGHTS_NAME)


def test_flipped_bytes_in_the_weights_are_refused_naming_the_file(head_dir, tiny_llama):
    _flip_a_weight_byte(head_dir)
    with pytest.raises(HeadFormatError, match=rf"{head_dir / WEIGHTS_NAME}: sha256 .* 'weights_sha256'"):
        load_head(head_dir, base_model=tiny_llama)


def test_the_cli_says_so_in_one_line(head_dir, tmp_path, capsys):
    _flip_a_weight_byte(head_dir)
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"{head_dir / WEIGHTS_NAME}: sha256" in error
    assert not (tmp_path / "out").exists()


def test_a_head_saved_without_the_hash_still_loads(head_dir, tiny_llama):
    config = json.loads((head_dir / CONFIG_NAME).read_text())
    config.pop("weights_sha256", None)
    (head_dir / CONFIG_NAME).write_text(json.dumps(config))
    assert load_head(head_dir, base_model=tiny_llama).kind == "medusa"


def test_a_malformed_hash_names_the_field(head_dir):
    config = json.loads((head_dir / CONFIG_NAME).read_text())
    config["weights_sha256"] = 12
    (head_dir / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(HeadFormatError, match=r"field 'weights_sha256' must be .*got a number 12"):
        load_head(head_dir)


@pytest.mark.parametrize("name", sorted(SHIPPED_HEADS))
def test_the_shipped_heads_carry_the_hash_of_their_weights(name):
    directory = shipped_head_dir(name)
    config = json.loads((directory / CONFIG_NAME).read_text())
    assert config["weights_sha256"] == file_sha256(directory / WEIGHTS_NAME)
