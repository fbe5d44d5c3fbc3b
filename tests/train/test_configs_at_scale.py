"""The GPU configs build their heads on the bases they name, at those bases' real shapes
(configs/bases/*.json, no weights: the base is built on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftheads.config import load_run_config
from draftheads.heads import build_head

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GPU_CONFIGS = sorted(CONFIGS.glob("*_8gpu.yaml"))
# Feature layers EAGLE-3 derives when unset: (2, L//2, L-3).
EXPECTED_FEATURES = {"llama3-8b": (2, 16, 29), "qwen3-8b": (2, 18, 33)}


def meta_base(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((CONFIGS / "bases" / f"{name}.json").read_text())
    config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_a_gpu_config_builds_its_head_at_its_bases_shapes(path):
    base_name = path.stem.split("_")[0]
    run = load_run_config(path)
    base = meta_base(base_name)
    with torch.device("meta"):  # shapes and dtypes only: an 8B base's heads hold up to 2.7B parameters
        head = build_head(base, run.head, run.model.base)
    assert next(head.parameters()).dtype == torch.bfloat16
    for name, table in head.named_buffers():
        if name.endswith("inv_freq"):
            assert table.dtype == torch.float32, name
    if run.head.kind == "eagle3":
        assert head.feature_layers[:3] == EXPECTED_FEATURES[base_name]
        # the layout vLLM, SGLang, speculators and llama.cpp load an EAGLE-3 drafter as
        assert head.layer_config.model_type == "llama"


def test_an_eagle3_head_whose_layers_no_engine_loads_says_so():
    from draftheads.heads import Eagle3Config

    base = meta_base("qwen3-8b")
    with torch.device("meta"):
        own_layers = build_head(base, Eagle3Config(draft_vocab_size=32000))
        engine_layers = build_head(base, Eagle3Config(draft_vocab_size=32000, layer_architecture="llama"))
    assert "set head.layer_architecture: llama" in own_layers.engine_layout_problem()
    assert engine_layers.engine_layout_problem() is None
