"""The ``mtp-deepseek`` format (``draftheads.export.mtp``).

Source of the asserted names: vllm-project/vllm vllm/model_executor/models/deepseek_mtp.py:
model.layers.{L+k}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens,
<decoder layer>}.
"""

from __future__ import annotations

import pytest
import torch
from format_fixtures import HIDDEN, LAYERS, VOCAB, make_head
from safetensors.torch import load_file

from draftheads.export import FormatError, mtp, write_head


def test_mtp_deepseek_layout(tiny_llama, tmp_path, monkeypatch):
    # No registered draft architecture is DeepSeek-V3 yet, so the naming is checked on a Llama MTP
    # head with the base-type gate opened; the gate itself is tested below.
    monkeypatch.setattr(mtp, "MTP_BASE_TYPES", ("llama",))
    head = make_head(tiny_llama, "mtp")
    config = write_head(head, tmp_path, "mtp-deepseek")
    tensors = load_file(str(tmp_path / mtp.MTP_WEIGHTS_NAME))
    assert config["num_nextn_predict_layers"] == 2
    for index, layer in enumerate((LAYERS, LAYERS + 1)):
        prefix = f"model.layers.{layer}."
        for name, shape in {
            "enorm.weight": (HIDDEN,),
            "hnorm.weight": (HIDDEN,),
            "eh_proj.weight": (HIDDEN, 2 * HIDDEN),
            "shared_head.norm.weight": (HIDDEN,),
            "shared_head.head.weight": (VOCAB, HIDDEN),
            "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, 128),
        }.items():
            assert tuple(tensors[prefix + name].shape) == shape
        assert torch.equal(tensors[prefix + "eh_proj.weight"], head.module_list[index].eh_proj.weight)
    assert f"model.layers.{LAYERS}.embed_tokens.weight" in tensors
    assert f"model.layers.{LAYERS + 1}.embed_tokens.weight" not in tensors  # loaded from the first only


def test_mtp_deepseek_refuses_non_deepseek_base(tiny_llama, tmp_path):
    with pytest.raises(FormatError, match="base model_type is 'llama'.*deepseek_v3"):
        write_head(make_head(tiny_llama, "mtp"), tmp_path, "mtp-deepseek")
