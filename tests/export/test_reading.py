"""Engine formats: exact layouts (checked against the engines' loaders), round trips, refusals.

Sources of the asserted names (repository, path):
- sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3; keys fc, midlayer.*
  (q/k/v/o, gate/up/down, input_layernorm, hidden_norm, post_attention_layernorm), norm, lm_head,
  d2t (hot_token_id = d2t + arange), t2d skipped; reads config.draft_vocab_size; tie_word_embeddings
  true makes lm_head the embedding.
- vllm-project/vllm vllm/model_executor/models/llama_eagle3.py: renames "midlayer." -> "layers.0.",
  d2t -> draft_id_to_target_id, fc input 3 * hidden; registry maps LlamaForCausalLMEagle3 there.
- vllm-project/vllm vllm/model_executor/models/llama_eagle.py: EagleLlamaForCausalLM, fc without
  bias, layers.0 with input_layernorm replaced by Identity (no weight), lm_head from the target.
- sgl-project/sglang python/sglang/srt/models/llama_eagle.py: LlamaForCausalLMEagle, fc with bias.
- vllm-project/vllm vllm/model_executor/models/medusa.py + vllm/transformers_utils/configs/medusa.py:
  blocks.{h}.layers.{l}.{weight,bias} (bias iff medusa_fc_bias), lm_heads.{h}.weight; config
  num_heads, num_hidden_layers, hidden_size, vocab_size, truncated_vocab_size.
- vllm-project/vllm vllm/transformers_utils/configs/speculators/{base,algos}.py: speculators_model_type
  eagle3, transformer_layer_config, speculators_config.proposal_methods[0].speculative_tokens,
  verifier.name_or_path, draft_vocab_size, norm_before_residual (defaults to TRUE when absent).
- vllm-project/vllm vllm/model_executor/models/deepseek_mtp.py: model.layers.{L+k}.{enorm, hnorm,
  eh_proj, shared_head.norm, shared_head.head, embed_tokens, <decoder layer>}.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from draftheads.heads import HeadMismatchError, build_head, load_head
from draftheads.heads.eagle import EagleConfig
from draftheads.heads.eagle3 import Eagle3Config
from draftheads.heads.formats import (
    DRAFTHEADS_KEY,
    FORMAT_REGISTRY,
    FormatError,
    export_format,
    write_head,
)
from draftheads.heads.medusa import MedusaConfig
from draftheads.heads.mtp import MtpConfig

HIDDEN, VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 64, 256, 4, 2, 16  # tests/conftest.py TINY_LLAMA
DRAFT_VOCAB = 100


def perturbed(head, seed: int = 1):
    """Random weights everywhere (zero-initialised blocks would hide a mis-mapped tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return head


def make_head(base, kind: str, **overrides):
    configs = {
        "medusa": MedusaConfig(num_heads=3, num_layers=2),
        "eagle": EagleConfig(),
        # the 4-layer tiny base repeats the default (2, L//2, L-3) = (2, 2, 1): pick three layers
        "eagle3": Eagle3Config(draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3)),
        "mtp": MtpConfig(num_modules=2),
    }
    config = configs[kind] if not overrides else type(configs[kind])(**overrides)
    head = build_head(base, config, base_name="tiny-llama")
    if kind == "eagle3":  # a draft vocabulary that is not just the first N ids: d2t non-zero
        counts = torch.zeros(VOCAB)
        counts[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB]] = 1.0 + torch.arange(DRAFT_VOCAB)
        head.init_from_data(counts)
    return perturbed(head)


def draft_outputs(head, base) -> list[torch.Tensor]:
    """What decoding consumes from a head: draft_logits (parallel) or catch_up + one draft_step."""
    input_ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden_states = base(input_ids, output_hidden_states=True).hidden_states
        features = head.select_features(hidden_states)
        if head.drafting == "parallel":
            return [head.draft_logits(features)]
        length = input_ids.shape[1] - 1
        cache = head.new_cache()
        position_ids = torch.arange(length)[None]
        hidden, logits = head.catch_up(cache, features[:, :length], input_ids[:, 1:], position_ids)
        if head.kind == "mtp":
            return [hidden, logits]
        tokens = head.draft_to_target(logits.topk(2, dim=-1).indices)  # (1, 2) two children of the root
        past = cache.get_seq_length()
        mask = torch.zeros(1, 1, 2, past + 2)
        mask[..., past:] = torch.finfo(mask.dtype).min
        mask[0, 0, torch.arange(2), past + torch.arange(2)] = 0.0  # each node sees prefix + itself
        step_hidden, step_logits = head.draft_step(
            cache, 1, hidden[:, None].expand(1, 2, -1), tokens, torch.full((1, 2), length), mask
        )
        return [hidden, logits, step_hidden, step_logits]


def assert_same_drafts(original, loaded, base):
    for expected, actual in zip(draft_outputs(original, base), draft_outputs(loaded, base)):
        assert torch.equal(expected, actual)


ROUND_TRIPS = [
    ("draftheads", "medusa"),
    ("draftheads", "eagle"),
    ("draftheads", "eagle3"),
    ("draftheads", "mtp"),
    ("eagle3", "eagle3"),
    ("speculators", "eagle3"),
    ("eagle-sglang", "eagle"),
    ("medusa-vllm", "medusa"),
]


@pytest.mark.parametrize("format_name,kind", ROUND_TRIPS)
def test_round_trip_gives_identical_drafts(tiny_llama, tmp_path, format_name, kind):
    head = make_head(tiny_llama, kind)
    write_head(head, tmp_path, format_name)
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert type(loaded) is type(head) and loaded.config == head.config
    assert_same_drafts(head, loaded, tiny_llama)


def test_eagle_vllm_round_trip_with_bias_free_fc(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle")
    with torch.no_grad():
        head.fc.bias.zero_()  # vLLM's EagleLlamaForCausalLM has no fc bias
    write_head(head, tmp_path, "eagle")
    assert_same_drafts(head, load_head(tmp_path, base_model=tiny_llama), tiny_llama)


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


# ---- exact layouts ----------------------------------------------------------------------------


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
    from tests.conftest import make_tiny_llama

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
        "architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2,
    }
    assert config["hidden_size"] == HIDDEN and config["vocab_size"] == config["truncated_vocab_size"] == VOCAB
    assert config["medusa_fc_bias"] is True


def test_mtp_deepseek_layout(tiny_llama, tmp_path, monkeypatch):
    # No registered draft architecture is DeepSeek-V3 yet, so the naming is checked on a Llama MTP
    # head with the base-type gate opened; the gate itself is tested below.
    from draftheads.heads import formats

    monkeypatch.setattr(formats, "MTP_BASE_TYPES", ("llama",))
    head = make_head(tiny_llama, "mtp")
    config = write_head(head, tmp_path, "mtp-deepseek")
    tensors = load_file(str(tmp_path / formats.MTP_WEIGHTS_NAME))
    assert config["num_nextn_predict_layers"] == 2
    for index, layer in enumerate((LAYERS, LAYERS + 1)):
        prefix = f"model.layers.{layer}."
        for name, shape in {
            "enorm.weight": (HIDDEN,), "hnorm.weight": (HIDDEN,), "eh_proj.weight": (HIDDEN, 2 * HIDDEN),
            "shared_head.norm.weight": (HIDDEN,), "shared_head.head.weight": (VOCAB, HIDDEN),
            "self_attn.q_proj.weight": (HIDDEN, HIDDEN), "mlp.down_proj.weight": (HIDDEN, 128),
        }.items():
            assert tuple(tensors[prefix + name].shape) == shape
        assert torch.equal(tensors[prefix + "eh_proj.weight"], head.module_list[index].eh_proj.weight)
    assert f"model.layers.{LAYERS}.embed_tokens.weight" in tensors
    assert f"model.layers.{LAYERS + 1}.embed_tokens.weight" not in tensors  # loaded from the first only


# ---- refusals ---------------------------------------------------------------------------------


def test_format_that_cannot_hold_the_head_is_refused_with_alternatives(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    with pytest.raises(FormatError, match="cannot express a eagle3 head.*draftheads, eagle3, speculators"):
        write_head(head, tmp_path, "medusa-vllm")
    with pytest.raises(FormatError, match="unknown export format 'onnx'"):
        export_format("onnx", "eagle3")
    for name, chosen in FORMAT_REGISTRY.items():
        for kind in ("medusa", "eagle", "eagle3", "mtp"):
            if kind not in chosen.head_kinds:
                with pytest.raises(FormatError):
                    export_format(name, kind)


def test_mtp_deepseek_refuses_non_deepseek_base(tiny_llama, tmp_path):
    with pytest.raises(FormatError, match="base model_type is 'llama'.*deepseek_v3"):
        write_head(make_head(tiny_llama, "mtp"), tmp_path, "mtp-deepseek")


def test_eagle_vllm_refuses_a_non_zero_fc_bias(tiny_llama, tmp_path):
    with pytest.raises(FormatError, match="eagle-sglang"):
        write_head(make_head(tiny_llama, "eagle"), tmp_path, "eagle")


def test_eagle3_formats_need_three_feature_layers(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 3))
    with pytest.raises(FormatError, match="exactly 3"):
        write_head(head, tmp_path, "eagle3")


# ---- checkpoints published by others ----------------------------------------------------------


def strip_metadata(directory):
    saved = json.loads((directory / "config.json").read_text())
    saved.pop(DRAFTHEADS_KEY)
    (directory / "config.json").write_text(json.dumps(saved))


def test_third_party_eagle3_without_base_says_what_was_not_checked(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    write_head(head, tmp_path, "eagle3")
    strip_metadata(tmp_path)
    with pytest.warns(UserWarning, match="not checked: base num_hidden_layers"):
        loaded = load_head(tmp_path)
    assert loaded.config.draft_vocab_size == DRAFT_VOCAB
    assert loaded.base_spec.hidden_size == HIDDEN and loaded.base_spec.vocab_size == VOCAB
    attached = load_head(tmp_path, base_model=tiny_llama)
    assert_same_drafts(head, attached, tiny_llama)


def test_third_party_checkpoint_that_does_not_fit_the_base_is_refused(tiny_llama, tmp_path):
    from tests.conftest import make_tiny_llama

    write_head(make_head(tiny_llama, "eagle3"), tmp_path, "eagle3")
    strip_metadata(tmp_path)
    wider = make_tiny_llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(HeadMismatchError, match="hidden_size=64 in the checkpoint.*hidden_size=96"):
        load_head(tmp_path, base_model=wider)


def test_third_party_medusa_without_bias_and_with_prefix(tiny_llama, tmp_path):
    # vLLM's converter output: "medusa_heads." prefix possible, medusa_fc_bias false -> no bias tensors
    head = make_head(tiny_llama, "medusa")
    with torch.no_grad():
        for module in head.heads:
            for block in module.blocks:
                block.linear.bias.zero_()
    write_head(head, tmp_path, "medusa-vllm")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({f"medusa_heads.{k}": v for k, v in tensors.items() if not k.endswith(".bias")}, str(tmp_path / "model.safetensors"))
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop(DRAFTHEADS_KEY)
    saved["medusa_fc_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert_same_drafts(head, load_head(tmp_path, base_model=tiny_llama), tiny_llama)


def test_pickle_weights_are_read_with_weights_only_and_a_warning(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    write_head(head, tmp_path, "eagle3")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.warns(UserWarning, match=r"weights_only=True"):
        loaded = load_head(tmp_path, base_model=tiny_llama)
    assert_same_drafts(head, loaded, tiny_llama)


def test_pickle_with_code_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    torch.save({"fc.weight": Payload()}, tmp_path / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="(?i)weights.only|unsupported global|not allowed"):
            load_head(tmp_path)


def test_unknown_layout_error_lists_readable_formats(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    from safetensors.torch import save_file

    save_file({"wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match="readable: draftheads, eagle3"):
        load_head(tmp_path)


def test_bias_free_eagle_exports_to_vllm_and_round_trips(tmp_path, tiny_llama):
    """A head trained with fc_bias=false is what vLLM's EagleLlamaForCausalLM can hold."""
    from draftheads.heads import build_head, load_head
    from draftheads.heads.eagle import EagleConfig
    from draftheads.heads.formats import write_head

    head = build_head(tiny_llama, EagleConfig(fc_bias=False))
    assert head.fc.bias is None
    write_head(head, tmp_path / "vllm", "eagle")
    loaded = load_head(tmp_path / "vllm", base_model=tiny_llama)
    assert loaded.fc.bias is None
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
