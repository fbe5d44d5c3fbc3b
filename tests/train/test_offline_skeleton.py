"""Offline training reads no decoder layer of the base: ``load_base_skeleton`` holds the config,
embeddings, final norm and lm_head alone, fingerprints as the whole base does, and a run from a
feature cache trains the head a run with the whole base loaded trains."""

from __future__ import annotations

import pytest
import torch
from distributed_launch import empty_config, head_weights, run_options, write_conversations, write_tiny_base

from draftheads.base_model import load_base
from draftheads.base_skeleton import load_base_skeleton
from draftheads.cli import main
from draftheads.config import load_run_config
from draftheads.data.feature_identity import base_weights_hash
from draftheads.train import loop, setup


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("skeleton")
    conversations = write_conversations(root / "conversations.jsonl")
    return root, conversations, write_tiny_base(root / "base", conversations), empty_config(root)


def test_a_skeleton_holds_no_decoder_weight_and_fingerprints_as_the_whole_base(workspace):
    _, _, base, _ = workspace
    whole, _ = load_base(str(base), "float32", "cpu")
    skeleton, _ = load_base_skeleton(str(base), "float32", "cpu")
    real = {name for name, parameter in skeleton.named_parameters() if not parameter.is_meta}
    assert real == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for name in real:
        assert torch.equal(skeleton.get_parameter(name), whole.get_parameter(name)), name
    assert base_weights_hash(skeleton) == base_weights_hash(whole)
    with torch.no_grad():  # another layer weight: the fingerprint read from the files sees it
        whole.model.layers[1].mlp.up_proj.weight[-1, -1] += 1.0
    assert base_weights_hash(skeleton) != base_weights_hash(whole)


def test_offline_training_without_the_bases_layers_trains_what_the_whole_base_trains(workspace, monkeypatch):
    root, conversations, base, config = workspace
    features = root / "features"

    def options(output_dir):
        return [*run_options(base, conversations, output_dir, "eagle3", 0), f"data.features={features}"]

    shards = ["--dtype", "float32", "--no-progress"]
    assert main(["cache-features", "--config", str(config), *options(root / "unused"), *shards]) == 0
    whole_base, tokenizer = load_base(str(base), "float32", "cpu")
    with_layers = root / "with-layers"
    loop.run_training(
        load_run_config(config, options(with_layers)), base_model=whole_base, tokenizer=tokenizer
    )

    def refuse(*args, **kwargs):
        raise AssertionError("offline training loaded the whole base")

    monkeypatch.setattr(setup, "load_base", refuse)
    without_layers = root / "without-layers"
    loop.run_training(load_run_config(config, options(without_layers)))
    expected, actual = head_weights(with_layers), head_weights(without_layers)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
