"""EAGLE-3 engine formats (``draftheads.export.eagle3``): exact layouts, checked against the engines'
loaders, and the capture-layer conventions.

Sources of the asserted names (repository, path):
- sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3; keys fc, midlayer.*
  (q/k/v/o, gate/up/down, input_layernorm, hidden_norm, post_attention_layernorm), norm, lm_head,
  d2t (hot_token_id = d2t + arange), t2d skipped; reads config.draft_vocab_size; tie_word_embeddings
  true makes lm_head the embedding.
- vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: renames "midlayer." -> "layers.0.",
  d2t -> draft_id_to_target_id, fc input 3 * hidden; registry maps LlamaForCausalLMEagle3 there.
- vllm-project/vllm vllm/transformers_utils/configs/speculators/{base,algos}.py: speculators_model_type
  eagle3, transformer_layer_config, speculators_config.proposal_methods[0].speculative_tokens,
  verifier.name_or_path, draft_vocab_size, norm_before_residual (defaults to TRUE when absent).
"""

from __future__ import annotations

import json

import pytest
import torch
from format_fixtures import DRAFT_VOCAB, HEAD_DIM, HIDDEN, KV_HEADS, VOCAB, make_head
from safetensors.torch import load_file

from draftheads.export import DRAFTHEADS_KEY, FormatError, write_head
from draftheads.heads import load_head
from tests.conftest import make_tiny_llama


def test_eagle3_layout_matches_sglang_and_vllm_loaders(tiny_llama, tmp_path):
    config = write_head(make_head(tiny_llama, "eagle3"), tmp_path, "eagle3")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layer = {
        "self_attn.q_proj.weight": (HIDDEN, 2 * HIDDEN),  # q/k/v read concat(emb, hidden)
        "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (128, HIDDEN),
        "mlp.up_proj.weight": (128, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, 128),
        "input_layernorm.weight": (HIDDEN,),
        "hidden_norm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    expected = {f"midlayer.{k}": v for k, v in layer.items()} | {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "norm.weight": (HIDDEN,),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (VOCAB,),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # target id of draft id d is d + d2t[d] (SGLang hot_token_id), and exactly those ids are in t2d
    targets = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    assert tensors["t2d"][targets].all() and int(tensors["t2d"].sum()) == DRAFT_VOCAB
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == VOCAB and config["hidden_size"] == HIDDEN
    assert config["tie_word_embeddings"] is False
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == KV_HEADS
    assert config["rope_theta"] == tiny_llama.config.rope_parameters["rope_theta"]
    assert json.loads((tmp_path / "config.json").read_text()) == config


def test_eagle3_default_layers_are_left_to_the_engines(tmp_path):
    base = make_tiny_llama(num_hidden_layers=8)  # default (2, 4, 5): distinct
    config = write_head(make_head(base, "eagle3", draft_vocab_size=DRAFT_VOCAB), tmp_path, "eagle3")
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config
    assert load_head(tmp_path, base_model=base).feature_layers == (2, 4, 5)


def test_eagle3_non_default_layers_written_in_each_engines_convention(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3))
    config = write_head(head, tmp_path, "eagle3")
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: input of layer i = hs[i]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert loaded.feature_layers == (1, 2, 3)
    # a third-party config with only SGLang's field reads the same layers
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved[DRAFTHEADS_KEY], saved["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_head(tmp_path, base_model=tiny_llama).feature_layers == (1, 2, 3)


def test_speculators_config_matches_vllm_reader(tiny_llama, tmp_path):
    config = write_head(make_head(tiny_llama, "eagle3"), tmp_path, "speculators")
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # vLLM's default when absent would be True
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # hs indices = vLLM's convention
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "eagle3"
    assert speculators["proposal_methods"][0]["speculative_tokens"] == 3
    assert speculators["verifier"]["name_or_path"] == "tiny-llama"
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB and layer["hidden_size"] == HIDDEN
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)


def test_speculators_other_than_eagle3_are_refused(tiny_llama, tmp_path):
    write_head(make_head(tiny_llama, "eagle3"), tmp_path, "speculators")
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["speculators_model_type"] = "mlp"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(FormatError, match="speculators_model_type 'mlp' is not readable here"):
        load_head(tmp_path, base_model=tiny_llama)


def test_eagle3_formats_need_three_feature_layers(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 3))
    with pytest.raises(FormatError, match="exactly 3"):
        write_head(head, tmp_path, "eagle3")


@pytest.mark.parametrize("kind", ["eagle3", "speculators"])
def test_eagle3_formats_refuse_the_last_hidden_state(tiny_llama, tmp_path, kind):
    # hs[4] is the tiny base's normed output: no engine capture point holds it.
    head = make_head(tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 4))
    with pytest.raises(FormatError, match=r"reads hs\[4\].*--format draftheads"):
        write_head(head, tmp_path, kind)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("kind", ["eagle3", "speculators"])
def test_eagle3_formats_refuse_more_than_one_draft_layer(tiny_llama, tmp_path, kind):
    head = make_head(
        tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3), num_layers=2
    )
    with pytest.raises(FormatError, match="hold one draft layer; this head has 2.*--format draftheads"):
        write_head(head, tmp_path, kind)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("kind", ["eagle3", "speculators"])
@pytest.mark.parametrize("third_party", [False, True])
def test_eagle31_heads_written_as_vllm_reads_them_and_read_back(tiny_llama, tmp_path, kind, third_party):
    """vLLM's llama_eagle3.py builds ``fc_norm`` (one RMSNorm per captured state) and ``norm_output``
    from the draft's config, a speculators config's top level included (speculators/algos.py)."""
    head = make_head(
        tiny_llama,
        "eagle3",
        draft_vocab_size=DRAFT_VOCAB,
        feature_layers=(1, 2, 3),
        fc_norm=True,
        norm_output=True,
    )
    with torch.no_grad():  # off unit weight, so a norm read into the wrong slot shows
        for index, norm in enumerate(head.fc_norm):
            norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN) * (index + 1))
    config = write_head(head, tmp_path, kind)
    assert config["fc_norm"] is True and config["norm_output"] is True
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for index in range(3):
        assert torch.equal(tensors[f"fc_norm.{index}.weight"], head.fc_norm[index].weight)
    if third_party:  # only the engine's fields: the reader's own mapping, not our metadata
        saved = json.loads((tmp_path / "config.json").read_text())
        del saved[DRAFTHEADS_KEY]
        (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert loaded.config.fc_norm and loaded.config.norm_output
    expected = head.head_state_dict()
    assert loaded.head_state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.head_state_dict().items())


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_gguf_refuses_eagle31_heads(tiny_llama, tmp_path, flag):
    head = make_head(
        tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3), **{flag: True}
    )
    with pytest.raises(
        FormatError, match=f"format 'gguf'.*EAGLE-3.1's {flag}.*--format eagle3 or speculators"
    ):
        write_head(head, tmp_path, "gguf")
    assert not (tmp_path / "config.json").exists()


def peagle_head(base):
    """A P-EAGLE head of 3 depths with a non-default mask token and a draft vocabulary mapping."""
    from draftheads.heads import PEagleConfig, build_head

    config = PEagleConfig(
        draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3), ttt_steps=3, mask_token_id=7
    )
    head = build_head(base, config, base_name="tiny-llama")
    counts = torch.zeros(VOCAB)
    counts[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB]] = (
        1.0 + torch.arange(DRAFT_VOCAB)
    )
    head.init_from_data(counts)
    with torch.no_grad():
        head.mask_hidden.copy_(torch.linspace(-1.0, 1.0, head.mask_hidden.numel()).view_as(head.mask_hidden))
    return head


def peagle_chain(head, base) -> torch.Tensor:
    """Every depth's logits from one drafting forward after a 12-token prefix."""
    input_ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        features = head.select_features(base(input_ids, output_hidden_states=True).hidden_states)
        return head.draft_chain(head.new_cache(), features[:, :11], input_ids[:, 1:], 11, 3)


@pytest.mark.parametrize("third_party", [False, True])
def test_peagle_speculators_layout_is_what_vllm_reads_and_reads_back(tiny_llama, tmp_path, third_party):
    """vLLM serves a speculators ``peagle`` checkpoint as eagle3 with parallel drafting
    (speculators/base.py), its mask token from ``mask_token_id`` (algos.py ``update_peagle``) and its
    mask-row features from the ``mask_hidden`` tensor (llama_eagle3.py ``load_weights``)."""
    head = peagle_head(tiny_llama)
    config = write_head(head, tmp_path, "speculators")
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == 7 and config["norm_before_residual"] is False
    speculators = config["speculators_config"]
    assert speculators["algorithm"] == "peagle"
    assert speculators["proposal_methods"][0]["speculative_tokens"] == 3  # the trained depths
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, 3 * HIDDEN)  # speculators' PEagleDraftModel shape
    assert torch.equal(tensors["mask_hidden"].view(1, -1), head.mask_hidden)
    assert "layers.0.hidden_norm.weight" in tensors and "d2t" in tensors
    if third_party:  # only the engine's fields: the reader's own mapping, not our metadata
        saved = json.loads((tmp_path / "config.json").read_text())
        del saved[DRAFTHEADS_KEY]
        (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert loaded.kind == "peagle" and loaded.mask_token_id == 7 and loaded.num_draft_steps == 3
    expected = head.head_state_dict()
    assert loaded.head_state_dict().keys() == expected.keys()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.head_state_dict().items())
    assert torch.equal(peagle_chain(loaded, tiny_llama), peagle_chain(head, tiny_llama))


def test_a_peagle_checkpoint_without_mask_hidden_is_named(tiny_llama, tmp_path):
    from safetensors.torch import save_file

    write_head(peagle_head(tiny_llama), tmp_path, "speculators")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["mask_hidden"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match="speculators peagle checkpoint without 'mask_hidden'"):
        load_head(tmp_path, base_model=tiny_llama)


def test_peagle_has_no_eagle3_or_gguf_layout(tiny_llama, tmp_path):
    for format_name in ("eagle3", "gguf"):
        with pytest.raises(FormatError, match="cannot express a peagle head"):
            write_head(peagle_head(tiny_llama), tmp_path / format_name, format_name)
