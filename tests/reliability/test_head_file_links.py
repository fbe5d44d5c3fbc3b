"""A head directory's files are read only as files inside it: a symbolic link from a head to a file
elsewhere (a system file, another user's secrets) is refused, naming the link, before anything is
read or exported, so ``export`` (and ``--push-to-hub``) never carries another file's bytes."""

from __future__ import annotations

import json
import os

import pytest

from draftheads.cli import main
from draftheads.heads import build_head, load_head
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer.confidence import CONFIDENCE_FILE
from draftheads.infer.tree import TUNED_TREE_FILE


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


def _link_out(head_dir, name, elsewhere):
    """Make ``head_dir/name`` a link to a file outside the head: the head's own file moved out
    (so it still reads as a head), or a stranger's file."""
    elsewhere.mkdir(exist_ok=True)
    target = elsewhere / name
    if (head_dir / name).exists():
        os.replace(head_dir / name, target)
    else:
        target.write_text(json.dumps({"format": "not the head's", "secret": "do not upload"}))
    (head_dir / name).symlink_to(target)
    return target


@pytest.mark.parametrize("name", [CONFIDENCE_FILE, TUNED_TREE_FILE, "bench.json", WEIGHTS_NAME, CONFIG_NAME])
def test_export_refuses_a_head_file_that_links_outside_the_head(head_dir, tmp_path, capsys, name):
    target = _link_out(head_dir, name, tmp_path / "elsewhere")
    out = tmp_path / "out"
    assert main(["export", "--heads", str(head_dir), "--out", str(out)]) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{head_dir / name}: a symbolic link to {target}, outside the head directory" in err
    assert not out.exists()


def test_loading_refuses_weights_that_link_outside_the_head(head_dir, tmp_path):
    _link_out(head_dir, WEIGHTS_NAME, tmp_path / "elsewhere")
    with pytest.raises(HeadFormatError, match=f"{WEIGHTS_NAME}: a symbolic link to "):
        load_head(head_dir)


def test_a_link_that_stays_inside_the_head_is_read(head_dir, tmp_path):
    os.replace(head_dir / WEIGHTS_NAME, head_dir / "weights-v1.safetensors")
    (head_dir / WEIGHTS_NAME).symlink_to("weights-v1.safetensors")
    assert load_head(head_dir).kind == "medusa"
