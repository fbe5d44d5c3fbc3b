"""DFlash engine formats (``draftheads.export.dflash``): the layouts, read back into a head that
drafts exactly as the original, and the refusals.

Sources of the asserted names (repository, path):
- z-lab/dflash dflash/model.py: DFlashDraftModel; config dflash_config.{block_size, mask_token_id,
  target_layer_ids} (``extract_context_feature`` reads hidden_states[id + 1]); tensors fc,
  hidden_norm, layers.{i}.* (Qwen3 layers: q_norm/k_norm), norm; embedding and lm_head the target's.
- vllm-project/vllm vllm/transformers_utils/configs/speculators/algos.py ``update_dflash``:
  speculators_model_type dflash, mask_token_id, aux_hidden_state_layer_ids (target_layer_ids =
  aux - 1), draft_vocab_size, target_hidden_size; speculators src/speculators/models/dflash/config.py:
  transformer_layer_config (Qwen3Config), block_size.
"""

from __future__ import annotations

import json

import pytest
import torch
from format_fixtures import HIDDEN, VOCAB, perturbed
from safetensors.torch import load_file

from draftheads.export import DRAFTHEADS_KEY, FormatError, write_head
from draftheads.heads import DFlashConfig, build_head, load_head
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = DFlashConfig(num_layers=2, block_size=4, feature_layers=(1, 2, 3), layer_architecture="qwen3")


@pytest.fixture(scope="module")
def base():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def head(base):
    torch.manual_seed(0)
    return perturbed(build_head(base, CONFIG, base_name="tiny-llama"))


def block_logits(head, base) -> torch.Tensor:
    input_ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        features = head.select_features(base(input_ids, output_hidden_states=True).hidden_states)
        return head.draft_block(head.new_cache(), features[:, :9], 9, input_ids[:, 9])


EXPECTED_LAYER = {
    "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "self_attn.k_proj.weight": (32, HIDDEN),
    "self_attn.v_proj.weight": (32, HIDDEN),
    "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
    "mlp.gate_proj.weight": (128, HIDDEN),
    "mlp.up_proj.weight": (128, HIDDEN),
    "mlp.down_proj.weight": (HIDDEN, 128),
    "input_layernorm.weight": (HIDDEN,),
    "post_attention_layernorm.weight": (HIDDEN,),
}


def test_dflash_layout_matches_the_releases(head, tmp_path):
    config = write_head(head, tmp_path, "dflash")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    expected = {f"layers.{i}.{k}": v for i in range(2) for k, v in EXPECTED_LAYER.items()} | {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "hidden_norm.weight": (HIDDEN,),
        "norm.weight": (HIDDEN,),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {
        "block_size": 4,
        "mask_token_id": VOCAB - 1,
        "target_layer_ids": [0, 1, 2],
    }
    assert config["tie_word_embeddings"] is False and config["hidden_size"] == HIDDEN
    assert json.loads((tmp_path / "config.json").read_text()) == config


def test_speculators_layout_matches_vllm(head, tmp_path):
    config = write_head(head, tmp_path, "dflash-speculators")
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: target_layer_ids = aux - 1
    assert config["mask_token_id"] == VOCAB - 1 and config["block_size"] == 4
    assert config["draft_vocab_size"] == VOCAB and config["target_hidden_size"] == HIDDEN
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"


@pytest.mark.parametrize("format_name", ["dflash", "dflash-speculators", "draftheads"])
def test_read_back_drafts_exactly_as_the_original(base, head, format_name, tmp_path):
    write_head(head, tmp_path, format_name)
    loaded = load_head(tmp_path, base_model=base)
    assert loaded.kind == "dflash" and loaded.feature_layers == (1, 2, 3) and loaded.block_size == 4
    torch.testing.assert_close(block_logits(loaded, base), block_logits(head, base))


@pytest.mark.parametrize("format_name", ["dflash", "dflash-speculators"])
def test_a_release_without_our_metadata_reads_from_its_own_fields(base, head, format_name, tmp_path):
    write_head(head, tmp_path, format_name)
    config = json.loads((tmp_path / "config.json").read_text())
    del config[DRAFTHEADS_KEY]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_head(tmp_path, base_model=base)
    assert loaded.config.num_layers == 2 and loaded.config.layer_architecture == "qwen3"
    torch.testing.assert_close(block_logits(loaded, base), block_logits(head, base))


def test_base_architecture_layers_are_refused_by_the_engine_formats(base, tmp_path):
    llama_layers = build_head(base, DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 3)))
    for format_name in ("dflash", "dflash-speculators"):
        with pytest.raises(FormatError, match="layer_architecture: qwen3"):
            write_head(llama_layers, tmp_path / format_name, format_name)


def test_other_kinds_cannot_be_written_as_dflash(base, tmp_path):
    from format_fixtures import make_head

    with pytest.raises(FormatError, match="cannot express a eagle3 head"):
        write_head(make_head(base, "eagle3"), tmp_path, "dflash")


def test_a_missing_layer_list_is_named(head, tmp_path):
    write_head(head, tmp_path, "dflash-speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="aux_hidden_state_layer_ids"):
        load_head(tmp_path)


@pytest.mark.parametrize("kind", ["dflash", "dflash-speculators"])
def test_dflash_formats_refuse_the_last_hidden_state(base, tmp_path, kind):
    # hs[4] is the tiny base's normed output; the engines' "output of layer 3" is not normed.
    config = DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 4), layer_architecture="qwen3")
    head = build_head(base, config, base_name="tiny-llama")
    with pytest.raises(FormatError, match=r"reads hs\[4\].*--format draftheads"):
        write_head(head, tmp_path, kind)
    assert not (tmp_path / "config.json").exists()
