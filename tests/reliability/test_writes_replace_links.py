"""What draftheads writes into a directory it did not create (a head directory: fit-confidence,
tune-tree, a head save) goes to a temporary file beside the target, renamed over it: a symbolic link
there is replaced, never written through, so the file it points to stays as it was."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.heads import build_head, load_head
from draftheads.heads.base import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer.confidence import (
    CONFIDENCE_CONFIG,
    CONFIDENCE_FILE,
    ConfidenceHead,
    load_confidence,
    save_confidence,
)
from draftheads.infer.tree import TUNED_TREE_FILE, StaticTree, load_tuned_tree, tuned_tree_key
from draftheads.optional import available
from draftheads.tuning.search import Candidate
from draftheads.tuning.step_cost import CostCurve
from draftheads.tuning.tune import save_tuned_tree

OTHER = "another user's file\n"
MATPLOTLIB = available("matplotlib")  # tune-tree's chart


def _links_to_elsewhere(directory, names, elsewhere):
    """Make each of ``names`` in ``directory`` a link to a file of ``elsewhere`` holding OTHER."""
    directory.mkdir(parents=True, exist_ok=True)
    elsewhere.mkdir(exist_ok=True)
    targets = []
    for name in names:
        (elsewhere / name).write_text(OTHER)
        (directory / name).symlink_to(elsewhere / name)
        targets.append(elsewhere / name)
    return targets


def _replaced_not_written_through(directory, names, targets):
    assert all((directory / name).is_file() and not (directory / name).is_symlink() for name in names)
    assert [target.read_text() for target in targets] == [OTHER] * len(targets)
    assert [path.name for path in directory.iterdir() if ".tmp" in path.name] == []


def test_fit_confidence_replaces_links_in_the_head_not_their_targets(tmp_path):
    head_dir, names = tmp_path / "head", [CONFIDENCE_FILE, CONFIDENCE_CONFIG]
    targets = _links_to_elsewhere(head_dir, names, tmp_path / "elsewhere")
    save_confidence(ConfidenceHead(hidden=4), head_dir, {"fitted_on": "test"})
    _replaced_not_written_through(head_dir, names, targets)
    assert load_confidence(head_dir).hidden == 4


def test_tune_tree_replaces_links_in_the_head_not_their_targets(tmp_path):
    key = tuned_tree_key(torch.float32, "cpu")
    head_dir, elsewhere = tmp_path / "head", tmp_path / "elsewhere"
    best = Candidate(StaticTree("tuned-2", ((0,),)), 2, 1.5, 1.1, 1.36)
    record = {
        "machine": {"cpu": "test"},
        "acceptance": {"probabilities": [[0.5]], "counts": [4]},
        "verify_cost": {
            "sizes": [1, 2],
            "relative": [1.0, 1.1],
            "seconds": [0.1, 0.11],
            "fitted_seconds": [0.1, 0.11],
        },
        "setting": key,
        "chosen": {"nodes": 2, "tree": {"name": "tuned-2"}},
        "candidates": [{"nodes": 2, "expected_speedup": 1.36}],
    }
    costs = {1: CostCurve((1, 2), (0.1, 0.11))}
    names = [f"tune-{key.replace('/', '-')}.json", f"tune-{key.replace('/', '-')}.png"]
    targets = _links_to_elsewhere(head_dir, names, elsewhere)
    save_tuned_tree(head_dir, key, best, record, costs)
    _replaced_not_written_through(head_dir, names[:1] if not MATPLOTLIB else names, targets)
    assert load_tuned_tree(head_dir, torch.float32, "cpu") == best.tree
    # tree.json is merged with what it held: a link out of the head is refused, not read or written
    (tree,) = _links_to_elsewhere(tmp_path / "another-head", [TUNED_TREE_FILE], elsewhere)
    with pytest.raises(HeadFormatError, match=f"{TUNED_TREE_FILE}: a symbolic link to {tree}"):
        save_tuned_tree(tmp_path / "another-head", key, best, record, costs)
    assert tree.read_text() == OTHER


def test_a_head_save_replaces_links_not_their_targets(tiny_llama, tmp_path):
    head_dir, names = tmp_path / "head", [WEIGHTS_NAME, CONFIG_NAME]
    targets = _links_to_elsewhere(head_dir, names, tmp_path / "elsewhere")
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny")
    head.save_pretrained(head_dir)
    _replaced_not_written_through(head_dir, names, targets)
    assert json.loads((head_dir / CONFIG_NAME).read_text())["head_kind"] == "medusa"
    assert load_head(head_dir).kind == "medusa"


@pytest.mark.parametrize("fails", [True, False])
def test_an_atomic_write_leaves_no_temporary_file(tmp_path, fails):
    from draftheads.storage import write_atomically

    def write(temporary):
        temporary.write_bytes(b"new")
        if fails:
            raise RuntimeError("the writer failed half way")

    (tmp_path / "kept.bin").write_bytes(b"old")
    if fails:
        with pytest.raises(RuntimeError):
            write_atomically(tmp_path / "kept.bin", write)
    else:
        write_atomically(tmp_path / "kept.bin", write)
    assert (tmp_path / "kept.bin").read_bytes() == (b"old" if fails else b"new")
    assert [path.name for path in tmp_path.iterdir()] == ["kept.bin"]


def test_the_metrics_log_is_never_appended_through_a_link(tmp_path):
    from draftheads.train.reporting import METRICS_NAME, Reporter

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reporter = Reporter(run_dir, config={}, enabled=True)
    reporter.log({"step": 1, "loss": 1.0})
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("a user's file\n")
    (run_dir / METRICS_NAME).unlink()
    (run_dir / METRICS_NAME).symlink_to(elsewhere)  # put in the log's place during the run
    with pytest.raises(OSError):
        reporter.log({"step": 2, "loss": 0.5})
    assert elsewhere.read_text() == "a user's file\n"
