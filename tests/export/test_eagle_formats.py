"""EAGLE-1 engine formats (``draftheads.export.eagle``): vLLM's bias-free ``eagle`` and SGLang's
``eagle-sglang``.

Sources of the asserted names (repository, path):
- vllm-project/vllm vllm/model_executor/models/llama_eagle.py: EagleLlamaForCausalLM, fc without
  bias, layers.0 with input_layernorm replaced by Identity (no weight), lm_head from the target.
- sgl-project/sglang python/sglang/srt/models/llama_eagle.py: LlamaForCausalLMEagle, fc with bias.
"""

from __future__ import annotations

import pytest
import torch
from format_fixtures import HEAD_DIM, HIDDEN, KV_HEADS, assert_same_drafts, make_head
from safetensors.torch import load_file

from draftheads.export import FormatError, write_head
from draftheads.heads import build_head, load_head
from draftheads.heads.eagle import EagleConfig


def test_eagle_layouts_match_vllm_and_sglang(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle")
    sglang_config = write_head(head, tmp_path / "sglang", "eagle-sglang")
    with torch.no_grad():
        head.fc.bias.zero_()
    vllm_config = write_head(head, tmp_path / "vllm", "eagle")
    layer = {
        "layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "layers.0.mlp.gate_proj.weight": (128, HIDDEN),
        "layers.0.mlp.up_proj.weight": (128, HIDDEN),
        "layers.0.mlp.down_proj.weight": (HIDDEN, 128),
        "layers.0.post_attention_layernorm.weight": (HIDDEN,),  # no input_layernorm: identity
        "fc.weight": (HIDDEN, 2 * HIDDEN),
    }
    vllm = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    sglang = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in vllm.items()} == layer
    assert {k: tuple(v.shape) for k, v in sglang.items()} == layer | {"fc.bias": (HIDDEN,)}
    assert vllm_config["architectures"] == ["EagleLlamaForCausalLM"]
    assert sglang_config["architectures"] == ["LlamaForCausalLMEagle"]
    for config in (vllm_config, sglang_config):
        assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False


def test_eagle_vllm_round_trip_with_bias_free_fc(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle")
    with torch.no_grad():
        head.fc.bias.zero_()  # vLLM's EagleLlamaForCausalLM has no fc bias
    write_head(head, tmp_path, "eagle")
    assert_same_drafts(head, load_head(tmp_path, base_model=tiny_llama), tiny_llama)


def test_eagle_vllm_refuses_a_non_zero_fc_bias(tiny_llama, tmp_path):
    with pytest.raises(FormatError, match="eagle-sglang"):
        write_head(make_head(tiny_llama, "eagle"), tmp_path, "eagle")


def test_bias_free_eagle_exports_to_vllm_and_round_trips(tmp_path, tiny_llama):
    """A head trained with fc_bias=false is what vLLM's EagleLlamaForCausalLM can hold."""
    head = build_head(tiny_llama, EagleConfig(fc_bias=False))
    assert head.fc.bias is None
    write_head(head, tmp_path / "vllm", "eagle")
    loaded = load_head(tmp_path / "vllm", base_model=tiny_llama)
    assert loaded.fc.bias is None
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
