"""tune-tree on the real SmolLM2 with a fresh EAGLE-3 head: the whole measurement runs on the real
shapes (30 layers, reduced draft vocabulary) and the choice is saved and loaded back."""

from __future__ import annotations

import pytest
import torch

from draftheads.heads import Eagle3Config, build_head
from draftheads.infer.tree import DynamicTree, load_tuned_tree
from draftheads.infer.verify_cost import load_tuned_costs
from draftheads.tuning.tune import TuneSettings, tune_tree


@pytest.mark.integration
def test_tune_tree_on_smollm2(smollm2, tmp_path):
    model, tokenizer = smollm2
    head = build_head(model, Eagle3Config(draft_vocab_size=2048, ttt_steps=2), "smollm2-135m-instruct").eval()
    settings = TuneSettings(
        data="mt-bench",
        skip=0,
        prompts=1,
        max_new_tokens=16,
        max_depth=3,
        top_k=4,
        max_nodes=8,
        prefix_tokens=32,
        repeats=1,
        batch_sizes=(2,),
    )
    record = tune_tree(model, head, tokenizer, tmp_path, settings, progress=False)
    acceptance = record["acceptance"]
    assert len(acceptance["probabilities"]) == 3 and all(len(row) == 4 for row in acceptance["probabilities"])
    assert acceptance["counts"][0] == 16  # one judged depth-1 draft per generated token
    cost = record["verify_cost"]
    assert cost["sizes"] == [1, 4, 8] and cost["relative"][0] == 1.0  # fp32 on CPU pads to 4
    relative = cost["relative"]  # timings are noise-bound on a shared host: only the fit's shape is sure
    assert all(0 < seconds for seconds in cost["seconds"])
    assert relative == sorted(relative)  # the isotonic fit: a bigger tree is never cheaper
    costs = load_tuned_costs(tmp_path, torch.float32, "cpu")  # measured here: used here
    assert sorted(costs) == [1, 2] and costs[2].sizes == (1, 4, 8)
    assert all(0 < seconds for curve in costs.values() for seconds in curve.seconds)
    tuned = load_tuned_tree(tmp_path, torch.float32, "cpu")
    assert isinstance(tuned, DynamicTree) and tuned.name == record["chosen"]["tree"]["name"]
    assert tuned.total_tokens <= 8 and tuned.depth <= 3
