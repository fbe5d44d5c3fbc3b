"""Draft heads on a tiny random Gemma 3: draft layers are the base's own Gemma 3 layers, built as
full attention with the full-attention rotary table; the layer parts EAGLE-3 and DFlash run one by
one combine as the layer's own forward (Gemma's sandwich norms); heads embed with Gemma's
sqrt(hidden_size) scale; norms copied from the base scale as the base's (1 + w); every kind trains
a step; a 32,000-id draft vocabulary of the 262,144-id vocabulary; save and load."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import HEAD_CONFIGS, base_hidden_states, token_counts

from draftheads.heads import DFlashConfig, Eagle3Config, EagleConfig, build_head, load_head
from draftheads.heads.layers import (
    add_attention,
    add_feed_forward,
    build_decoder_layer,
    build_rotary_embedding,
    prefix_causal_mask,
)
from draftheads.infer import SpeculativeGenerator
from draftheads.train.objective import compute_objective
from tests.conftest import make_tiny_gemma3, make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIGS = {
    **HEAD_CONFIGS,
    "eagle3-from-base": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, init_from_base=True),
    "eagle3-llama-layer": Eagle3Config(
        feature_layers=(1, 2, 3), draft_vocab_size=64, layer_architecture="llama"
    ),
    "dflash": DFlashConfig(num_layers=2, block_size=4, feature_layers=(1, 2, 3)),
    "dflash-qwen3-layers": DFlashConfig(
        num_layers=1, block_size=4, feature_layers=(1, 2, 3), layer_architecture="qwen3"
    ),
}


@pytest.fixture(scope="module")
def model():
    return make_tiny_gemma3()


def sequence(length: int = 16, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def test_draft_layers_are_full_attention_gemma3_layers(model):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    layer = build_decoder_layer(model.config, layer_idx=0)
    assert isinstance(layer, Gemma3DecoderLayer) and not layer.self_attn.is_sliding
    assert model.config.layer_types[0] == "sliding_attention"  # the base config is left as it was
    hidden, positions = torch.randn(1, 5, 64), torch.arange(5)[None]
    cos, _ = build_rotary_embedding(model.config)(hidden, positions)
    full_cos, _ = model.model.rotary_emb(hidden, positions, "full_attention")
    sliding_cos, _ = model.model.rotary_emb(hidden, positions, "sliding_attention")
    torch.testing.assert_close(cos, full_cos)
    assert not torch.allclose(cos, sliding_cos)


@pytest.mark.parametrize("make_model", [make_tiny_llama, make_tiny_gemma3], ids=["llama", "gemma3"])
def test_layer_parts_combine_as_the_layers_own_forward(make_model):
    base = make_model()
    torch.manual_seed(1)
    layer = build_decoder_layer(base.config, layer_idx=0)
    with torch.no_grad():
        for parameter in layer.parameters():  # norms away from their initial scale, so each counts
            parameter.normal_(0, 0.3)
    hidden, positions = torch.randn(1, 6, 64), torch.arange(6)[None]
    rotary = build_rotary_embedding(base.config)(hidden, positions)
    mask = prefix_causal_mask(1, 0, 6, torch.float32, "cpu")
    model_type = base.config.model_type
    with torch.no_grad():
        expected = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        attended, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden),
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=rotary,
        )
        actual = add_feed_forward(layer, model_type, add_attention(layer, model_type, hidden, attended))
    torch.testing.assert_close(actual, expected)


def test_heads_embed_tokens_as_the_base_does(model):
    head = build_head(model, EagleConfig())
    input_ids = sequence()
    embedded = head.embed_tokens(input_ids)
    torch.testing.assert_close(embedded, base_hidden_states(model, input_ids)[0])
    torch.testing.assert_close(embedded, model.model.embed_tokens.weight[input_ids] * 64**0.5)


@pytest.mark.parametrize("kind", ["mtp", "dflash", "dflash-qwen3-layers"])
def test_norms_copied_from_the_base_scale_as_the_bases(kind):
    base = make_tiny_gemma3()
    with torch.no_grad():
        base.model.norm.weight.normal_(0, 0.5)
    head = build_head(base, CONFIGS[kind])
    norm = head.module_list[0].norm if kind == "mtp" else head.norm
    states = torch.randn(2, 5, 64)
    torch.testing.assert_close(norm(states), base.model.norm(states))


@pytest.mark.parametrize("kind", ["eagle3-llama-layer", "dflash-qwen3-layers"])
def test_engine_layouts_have_the_silu_mlp_the_engines_build(model, kind):
    """vLLM's Llama and Qwen3 drafter MLPs are SiLU only; Gemma's is GELU (tanh)."""
    head = build_head(model, CONFIGS[kind])
    assert model.config.hidden_activation == "gelu_pytorch_tanh"
    assert head.layer_config.hidden_act == "silu" and head.layer_config.model_type != "gemma3_text"


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_kind_trains_a_step(model, kind):
    torch.manual_seed(0)
    input_ids = sequence(20)  # past the window of 8
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0
    head = build_head(model, CONFIGS[kind])
    head.init_from_data(token_counts(input_ids, model.config.vocab_size))
    head.train()
    hidden_states = base_hidden_states(model, input_ids)
    output = compute_objective(head, hidden_states, input_ids, loss_mask, torch.ones_like(input_ids))
    assert torch.isfinite(output.loss)
    output.loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert not any(p.grad is not None for p in model.parameters())


def test_a_reduced_draft_vocabulary_of_gemmas_262k_ids():
    """The default EAGLE-3 draft vocabulary (32,000 ids) over Gemma's 262,144: the most counted
    ids, mapped back to base ids; greedy decoding through it stays the base's."""
    base = make_tiny_gemma3(vocab_size=262_144, hidden_size=32, intermediate_size=64)
    torch.manual_seed(0)
    head = build_head(base, Eagle3Config(feature_layers=(1, 2, 3)))
    counts = torch.zeros(262_144, dtype=torch.long)
    counted = torch.randperm(262_144, generator=torch.Generator().manual_seed(4))[:40_000]
    counts[counted] = torch.arange(40_000, 0, -1)  # a strict order: the first 32,000 are the most counted
    head.init_from_data(counts)
    assert head.draft_vocab_size == 32_000 and head.lm_head.out_features == 32_000
    targets = head.draft_to_target(torch.arange(32_000))
    assert set(targets.tolist()) == set(counted[:32_000].tolist())
    assert int(head.t2d.sum()) == 32_000 and bool(head.t2d[targets].all())
    prompt = torch.randint(3, 262_144, (1, 12), generator=torch.Generator().manual_seed(5))
    expected = base.generate(prompt, max_new_tokens=16, do_sample=False)
    result = SpeculativeGenerator(base, head, tree="chain-4").generate(prompt, max_new_tokens=16)
    assert result.sequences.tolist() == expected.tolist()


def test_save_and_load_round_trip(model, tmp_path):
    torch.manual_seed(0)
    head = build_head(model, CONFIGS["eagle3"]).eval()
    head.save_pretrained(tmp_path / "eagle3")
    loaded = load_head(tmp_path / "eagle3", base_model=model).eval()
    assert loaded.base_config.model_type == "gemma3_text"
    assert loaded.base_config.layer_types == model.config.layer_types
    input_ids = sequence()
    features = head.select_features(base_hidden_states(model, input_ids))[:, :-1]
    positions = torch.arange(input_ids.shape[1] - 1)[None]
    with torch.no_grad():
        expected = head.catch_up(head.new_cache(), features, input_ids[:, 1:], positions)
        actual = loaded.catch_up(loaded.new_cache(), features, input_ids[:, 1:], positions)
    torch.testing.assert_close(actual, expected)
