"""Damaged or hand-edited inputs that export, bench and generate read beside a head (the confidence
head, tree.json, the head's own widths, a target GGUF) end as one line naming the file and the
field, with the status of their kind (4: head or checkpoint files), never a traceback. A width is
checked against the weights' shapes before anything of that width is allocated: a size of 10**12
is refused from the numbers, not by trying to allocate terabytes."""

from __future__ import annotations

import json

import pytest

from draftheads.cli import main
from draftheads.heads import build_head, load_head
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError
from draftheads.heads.eagle3 import Eagle3Config
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer.confidence import (
    CONFIDENCE_CONFIG,
    CONFIDENCE_FILE,
    ConfidenceFormatError,
    ConfidenceHead,
    load_confidence,
    save_confidence,
)
from draftheads.infer.tree import TUNED_TREE_FILE
from tests.export.format_fixtures import write_target
from tests.reliability.test_cli_errors import one_line

pytestmark = pytest.mark.usefixtures("single_thread")

HUGE = 10**12


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


@pytest.fixture
def eagle3_dir(tiny_llama, tmp_path):
    config = Eagle3Config(draft_vocab_size=100, feature_layers=(1, 2, 3))
    return build_head(tiny_llama, config, base_name="tiny-llama").save_pretrained(tmp_path / "eagle3")


def export(head_dir, out, *options: str) -> int:
    return main(["export", "--heads", str(head_dir), "--out", str(out), *options])


def test_export_names_a_truncated_confidence_config(head_dir, tmp_path, capsys):
    save_confidence(ConfidenceHead(hidden=4), head_dir, {"fitted_on": "test"})
    path = head_dir / CONFIDENCE_CONFIG
    path.write_text(path.read_text()[:20])
    assert export(head_dir, tmp_path / "out") == 4
    assert one_line(capsys, "export").startswith(f"{path}: ")
    assert not (tmp_path / "out").exists()


def test_export_names_a_tree_file_that_is_not_utf8(head_dir, tmp_path, capsys):
    path = head_dir / TUNED_TREE_FILE
    path.write_bytes(b'{"format": "\xff\xfe"}')
    assert export(head_dir, tmp_path / "out") == 4
    assert one_line(capsys, "export").startswith(f"{path}: ")
    assert not (tmp_path / "out").exists()


def test_a_confidence_width_its_weights_do_not_hold_is_refused_from_the_numbers(head_dir):
    save_confidence(ConfidenceHead(hidden=4), head_dir, {"fitted_on": "test"})
    path = head_dir / CONFIDENCE_CONFIG
    path.write_text(json.dumps(json.loads(path.read_text()) | {"hidden": HUGE}))
    with pytest.raises(ConfidenceFormatError) as caught:
        load_confidence(head_dir)
    message = str(caught.value)
    assert message.startswith(f"{path}: hidden: {HUGE}"), message
    assert f"{head_dir / CONFIDENCE_FILE}" in message and "holds a width of 4" in message


def test_a_head_width_its_weights_do_not_hold_is_refused_before_building(eagle3_dir, tmp_path, capsys):
    path = eagle3_dir / CONFIG_NAME
    config = json.loads(path.read_text())
    config["head_config"]["intermediate_size"] = HUGE
    path.write_text(json.dumps(config))
    with pytest.raises(HeadFormatError) as caught:
        load_head(eagle3_dir)
    message = str(caught.value)
    assert message.startswith(f"{eagle3_dir / WEIGHTS_NAME}: does not fit the head {path} describes"), message
    assert str(HUGE) in message and "mlp" in message
    assert export(eagle3_dir, tmp_path / "out") == 4
    assert one_line(capsys, "export") == message


@pytest.mark.parametrize("damage", ["text", "truncated"])
def test_export_names_a_target_gguf_it_cannot_read(eagle3_dir, tmp_path, capsys, damage):
    target = tmp_path / "target.gguf"
    if damage == "text":
        target.write_text("not a GGUF file, just some notes\n" * 4)
    else:
        whole = write_target(target).read_bytes()
        target.write_bytes(whole[: len(whole) - 1000])
    out = tmp_path / "out"
    assert export(eagle3_dir, out, "--format", "gguf", "--target-gguf", str(target)) == 4
    assert one_line(capsys, "export").startswith(f"format 'gguf': target GGUF {target}: ")
    assert not out.exists()
