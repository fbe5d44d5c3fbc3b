"""What would change a result without a word is refused in one line instead: a confidence head whose
weights are not finite (adaptive drafting would stop at the root, verifying nothing it drafted),
and a ``--speculative-tokens`` the head cannot draft (a P-EAGLE or DFlash head drafts its trained
depth in one forward: the export would record that depth, not the number asked for)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftheads.cli import main
from draftheads.heads import DFlashConfig, PEagleConfig, build_head
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer.confidence import (
    CONFIDENCE_FILE,
    ConfidenceFormatError,
    ConfidenceHead,
    load_confidence,
    save_confidence,
)
from tests.reliability.test_cli_errors import one_line

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_confidence_head_of_non_finite_weights_is_refused(head_dir, tmp_path, capsys, value):
    confidence = ConfidenceHead(hidden=4)
    with torch.no_grad():
        confidence.net[2].weight[0, 1] = value
    save_confidence(confidence, head_dir, {"fitted_on": "test"})
    with pytest.raises(ConfidenceFormatError) as caught:
        load_confidence(head_dir)
    assert str(caught.value).startswith(f"{head_dir / CONFIDENCE_FILE}: net.2.weight: 1 of 4 values")
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 4
    assert one_line(capsys, "export") == str(caught.value)


FIXED_DEPTH_HEADS = {  # kind: (config, format, the depth its export records)
    "peagle": (PEagleConfig(draft_vocab_size=100, feature_layers=(1, 2, 3), ttt_steps=3), "speculators", 3),
    "dflash": (
        DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 3), layer_architecture="qwen3"),
        "dflash-speculators",
        3,
    ),
}


@pytest.mark.parametrize("kind", FIXED_DEPTH_HEADS)
def test_speculative_tokens_a_head_cannot_draft_are_refused(tiny_llama, tmp_path, capsys, kind):
    config, format_name, depth = FIXED_DEPTH_HEADS[kind]
    head_dir = build_head(tiny_llama, config, base_name="tiny-llama").save_pretrained(tmp_path / "head")
    export = ["export", "--heads", str(head_dir), "--format", format_name]
    out = tmp_path / "out"
    assert main([*export, "--out", str(out), "--speculative-tokens", "7"]) == 3
    message = one_line(capsys, "export")
    assert message.startswith("--speculative-tokens 7: "), message
    assert f"drafts its {depth} trained" in message and f"--speculative-tokens {depth}" in message
    assert not out.exists()
    for asked in ([], ["--speculative-tokens", str(depth)]):  # its own depth, by default or asked for
        written = tmp_path / f"out-{len(asked)}"
        assert main([*export, "--out", str(written), *asked]) == 0
        proposal = json.loads((written / "config.json").read_text())["speculators_config"]["proposal_methods"]
        assert proposal[0]["speculative_tokens"] == depth
