"""The ``medusa-vllm`` format (``draftheads.export.medusa``).

Source of the asserted names: vllm-project/vllm vllm/model_executor/models/medusa.py +
vllm/transformers_utils/configs/medusa.py: blocks.{h}.layers.{l}.{weight,bias} (bias iff
medusa_fc_bias), lm_heads.{h}.weight; config num_heads, num_hidden_layers, hidden_size, vocab_size,
truncated_vocab_size.
"""

from __future__ import annotations

import json

import pytest
import torch
from format_fixtures import HIDDEN, VOCAB, assert_same_drafts, make_head, perturbed
from safetensors.torch import load_file, save_file

from draftheads.export import DRAFTHEADS_KEY, FormatError, write_head
from draftheads.heads import HeadMismatchError, load_head


def test_medusa_vllm_layout(tiny_llama, tmp_path):
    config = write_head(make_head(tiny_llama, "medusa"), tmp_path, "medusa-vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {}
    for index in range(3):
        for layer in range(2):
            expected[f"blocks.{index}.layers.{layer}.weight"] = (HIDDEN, HIDDEN)
            expected[f"blocks.{index}.layers.{layer}.bias"] = (HIDDEN,)
        expected[f"lm_heads.{index}.weight"] = (VOCAB, HIDDEN)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert {k: config[k] for k in ("architectures", "model_type", "num_heads", "num_hidden_layers")} == {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": 3,
        "num_hidden_layers": 2,
    }
    assert config["hidden_size"] == HIDDEN and config["vocab_size"] == config["truncated_vocab_size"] == VOCAB
    assert config["medusa_fc_bias"] is True


def test_shared_lm_head_medusa_is_materialised_for_vllm_and_read_back(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "medusa", num_heads=2, num_layers=1, shared_lm_head=True)
    write_head(head, tmp_path, "medusa-vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for index in range(2):
        assert torch.equal(tensors[f"lm_heads.{index}.weight"], tiny_llama.lm_head.weight)
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert loaded.config.shared_lm_head
    assert_same_drafts(head, loaded, tiny_llama)
    other_base = perturbed(type(tiny_llama)(tiny_llama.config).eval(), seed=9)
    with pytest.raises(HeadMismatchError, match="lm_head"):
        load_head(tmp_path, base_model=other_base)


def test_medusa_shared_lm_head_export_needs_the_base(tiny_llama, tmp_path):
    head = load_head(make_head(tiny_llama, "medusa", shared_lm_head=True).save_pretrained(tmp_path / "head"))
    with pytest.raises(FormatError, match="attached to its base model"):
        write_head(head, tmp_path / "out", "medusa-vllm")


def test_third_party_medusa_without_bias_and_with_prefix(tiny_llama, tmp_path):
    # vLLM's converter output: "medusa_heads." prefix possible, medusa_fc_bias false -> no bias tensors
    head = make_head(tiny_llama, "medusa")
    with torch.no_grad():
        for module in head.heads:
            for block in module.blocks:
                block.linear.bias.zero_()
    write_head(head, tmp_path, "medusa-vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(
        {f"medusa_heads.{k}": v for k, v in tensors.items() if not k.endswith(".bias")},
        str(tmp_path / "model.safetensors"),
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop(DRAFTHEADS_KEY)
    saved["medusa_fc_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert_same_drafts(head, load_head(tmp_path, base_model=tiny_llama), tiny_llama)


def test_third_party_medusa_without_base_assumes_a_llama_and_says_so(tiny_llama, tmp_path):
    write_head(make_head(tiny_llama, "medusa"), tmp_path, "medusa-vllm")
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop(DRAFTHEADS_KEY)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(UserWarning, match=r"base model_type \(assumed llama\)"):
        loaded = load_head(tmp_path)
    assert loaded.base_config.model_type == "llama" and loaded.config.num_heads == 3
