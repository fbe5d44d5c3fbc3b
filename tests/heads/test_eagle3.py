"""EAGLE-3: feature-layer choice and validation, the draft vocabulary (d2t / t2d), export names."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import TINY_LLAMA, move_norms_off_unit_weight
from transformers import LlamaConfig

from draftheads.heads import Eagle3Config, Eagle3Head, build_head
from draftheads.heads import eagle3 as eagle3_module
from draftheads.heads.base import head_config_from_dict
from draftheads.heads.eagle3 import grow_draft_vocabulary
from draftheads.heads.layers import prefix_causal_mask
from draftheads.settings import ConfigError


def thirty_layer_config(**overrides):
    return LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 30, **overrides})


def test_default_feature_layers_are_low_middle_high():
    head = Eagle3Head(Eagle3Config(), thirty_layer_config())
    assert head.feature_layers == (2, 15, 27)
    assert head.required_hidden_states == (2, 15, 27, 30)
    assert head.fc.in_features == 3 * 64


def test_feature_layer_beyond_the_base_depth_is_refused():
    with pytest.raises(ConfigError, match=r"head.feature_layers=\[2, 15, 31\]: index 31 .*valid 0..30"):
        Eagle3Head(Eagle3Config(feature_layers=(2, 15, 31)), thirty_layer_config())


def test_default_that_repeats_a_layer_on_a_shallow_base_says_to_set_it(tiny_llama):
    with pytest.raises(
        ConfigError, match=r"feature_layers=\[2, 2, 1\]: duplicate index.*set head.feature_layers"
    ):
        build_head(tiny_llama, Eagle3Config())


def test_config_section_rejects_duplicate_layers():
    with pytest.raises(ConfigError, match="feature_layers must be distinct"):
        head_config_from_dict({"kind": "eagle3", "feature_layers": [3, 3, 1]}, "head")
    config = head_config_from_dict({"kind": "eagle3", "feature_layers": [1, 2, 3]}, "head")
    assert config.feature_layers == (1, 2, 3)


def test_default_draft_vocab_is_capped():
    assert Eagle3Head(Eagle3Config(), thirty_layer_config(vocab_size=49152)).draft_vocab_size == 32000
    assert Eagle3Head(Eagle3Config(), thirty_layer_config(vocab_size=256)).draft_vocab_size == 256
    with pytest.raises(ConfigError, match="draft_vocab_size=300 exceeds the base vocab_size=256"):
        Eagle3Head(Eagle3Config(draft_vocab_size=300), thirty_layer_config())


def test_draft_vocabulary_maps_draft_ids_to_the_most_frequent_targets(tiny_llama):
    head = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=4))
    counts = torch.zeros(256, dtype=torch.long)
    counts[torch.tensor([200, 7, 90, 31, 5])] = torch.tensor([50, 40, 30, 20, 10])
    head.init_from_data(counts)
    most_frequent = torch.tensor([7, 31, 90, 200])  # top 4, in id order
    assert head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool
    assert torch.equal(head.d2t, most_frequent - torch.arange(4))
    assert torch.equal(head.draft_to_target(torch.arange(4)), most_frequent)
    assert torch.equal(head.t2d.nonzero().flatten(), most_frequent)
    assert not head.t2d[5]  # 5th most frequent: outside
    with pytest.raises(ValueError, match=r"token_counts must have shape \(256,\)"):
        head.init_from_data(torch.ones(10))


def test_checkpoint_names_match_the_sglang_format(tiny_llama):
    head = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    shapes = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    assert shapes == {
        "fc.weight": (hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (128, hidden),
        "midlayer.mlp.up_proj.weight": (128, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, 128),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (64, hidden),
        "d2t": (64,),
        "t2d": (256,),
    }


def test_init_from_base_makes_the_draft_layer_the_base_last_layer(tiny_llama):
    """Fed the hidden states entering the base's last layer as g, a head initialised from the base
    reproduces the base's logits over its draft vocabulary: the copied layer ignores the token
    embedding (its half of q/k/v starts at zero) and the norm and lm_head are the base's."""
    config = Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, init_from_base=True)
    head = build_head(tiny_llama, config)
    input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = tiny_llama(input_ids, output_hidden_states=True)
        positions = torch.arange(9)[None].expand(2, 9)
        mask = prefix_causal_mask(2, 0, 9, torch.float32, input_ids.device)
        state = head.step(out.hidden_states[-2], input_ids, positions, mask, None)
        drafted = head.logits(state)
    torch.testing.assert_close(drafted, out.logits[..., :64], rtol=1e-5, atol=1e-5)

    fresh = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    with torch.no_grad():
        control = fresh.logits(fresh.step(out.hidden_states[-2], input_ids, positions, mask, None))
    assert not torch.allclose(control, out.logits[..., :64], atol=1e-2)  # random weights do not


def test_init_from_base_gives_lm_head_the_rows_of_the_draft_vocabulary(tiny_llama):
    head = build_head(
        tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=4, init_from_base=True)
    )
    counts = torch.zeros(256, dtype=torch.long)
    counts[torch.tensor([200, 7, 90, 31, 5])] = torch.tensor([50, 40, 30, 20, 10])
    head.init_from_data(counts)
    base_rows = tiny_llama.get_output_embeddings().weight[torch.tensor([7, 31, 90, 200])]
    assert torch.equal(head.lm_head.weight, base_rows)
    # The embedding's norm keeps its fresh weights.
    assert torch.equal(head.midlayer.input_layernorm.weight, torch.ones(64))


def test_intermediate_size_widens_the_draft_mlp_only(tiny_llama):
    base_width = tiny_llama.config.intermediate_size
    default = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    config = Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, intermediate_size=3 * base_width)
    wide = build_head(tiny_llama, config)
    assert default.midlayer.mlp.up_proj.weight.shape == (base_width, 64)
    assert wide.midlayer.mlp.up_proj.weight.shape == (3 * base_width, 64)
    assert wide.midlayer.mlp.down_proj.weight.shape == (64, 3 * base_width)
    narrow = {k: v.shape for k, v in default.state_dict().items() if ".mlp." not in k}
    assert {k: v.shape for k, v in wide.state_dict().items() if ".mlp." not in k} == narrow
    assert tiny_llama.config.intermediate_size == base_width  # the base's config is not touched


def test_init_from_base_refuses_a_draft_mlp_of_another_width(tiny_llama):
    config = Eagle3Config(
        feature_layers=(1, 2, 3), draft_vocab_size=64, init_from_base=True, intermediate_size=96
    )
    with pytest.raises(ConfigError, match="head.intermediate_size=96 does not fit"):
        build_head(tiny_llama, config)


def test_intermediate_size_must_be_positive():
    with pytest.raises(ValueError, match="intermediate_size must be >= 1, got 0"):
        Eagle3Config(intermediate_size=0)


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_hard_target_weight_must_be_a_mix(weight):
    with pytest.raises(ValueError, match=f"hard_target_weight must be in \\[0, 1\\], got {weight}"):
        Eagle3Config(hard_target_weight=weight)


def test_objective_is_a_known_name_and_owns_the_hard_target_weight():
    assert Eagle3Config(objective="kl_acceptance").objective == "kl_acceptance"
    with pytest.raises(ValueError, match="objective must be one of .* got 'lk'"):
        Eagle3Config(objective="lk")
    with pytest.raises(ValueError, match="hard_target_weight \\(0.5\\) applies to the soft_ce objective"):
        Eagle3Config(objective="log_acceptance", hard_target_weight=0.5)


def one_step_inputs():
    """Fixed (features, input_ids, positions, mask) for one drafting step of 2 rows x 9 tokens."""
    features = torch.randn(2, 9, 3 * 64, generator=torch.Generator().manual_seed(2))
    input_ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9)[None].expand(2, 9)
    return features, input_ids, positions, prefix_causal_mask(2, 0, 9, torch.float32, input_ids.device)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_narrower_saved_head_grows_into_a_wider_mlp_and_drafts_the_same(tiny_llama, num_layers):
    """load_saved widens every draft layer's MLP without changing the drafts: the new units'
    down_proj columns start at zero. Training then moves them (their gate/up rows are fresh, not zero)."""
    narrow = build_head(
        tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, num_layers=num_layers)
    )
    with torch.no_grad():
        for parameter in narrow.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    wide = build_head(
        tiny_llama,
        Eagle3Config(
            feature_layers=(1, 2, 3), draft_vocab_size=64, intermediate_size=200, num_layers=num_layers
        ),
    )
    wide.load_saved(narrow)
    features, input_ids, positions, mask = one_step_inputs()
    with torch.no_grad():
        drafted = [
            h.logits(h.step(h.fuse(features), input_ids, positions, mask, None)) for h in (narrow, wide)
        ]
    torch.testing.assert_close(drafted[1], drafted[0], rtol=1e-5, atol=1e-5)
    for new_units in [wide.midlayer.mlp, *(layer.mlp for layer in wide.layers)]:
        assert torch.count_nonzero(new_units.down_proj.weight[:, 128:]) == 0
        assert torch.count_nonzero(new_units.up_proj.weight[128:]) > 0

    with pytest.raises(ConfigError, match="saved head's draft MLP is 200 wide.*can grow, not shrink"):
        narrow.load_saved(wide)


@pytest.mark.parametrize("width", [None, 200])
def test_a_saved_head_grows_more_draft_layers_and_drafts_the_same(tiny_llama, width):
    """load_saved appends the new layers as the identity (zero o_proj and down_proj, fresh
    everything else), alone or with a wider MLP; the first optimiser step gives them a gradient
    that reaches past the zero weights; fewer layers than saved is refused."""
    settings = {"feature_layers": (1, 2, 3), "draft_vocab_size": 64}
    one = build_head(tiny_llama, Eagle3Config(**settings))
    with torch.no_grad():
        for parameter in one.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    three = build_head(tiny_llama, Eagle3Config(**settings, num_layers=3, intermediate_size=width))
    three.load_saved(one)
    features, input_ids, positions, mask = one_step_inputs()
    with torch.no_grad():
        drafted = [h.logits(h.step(h.fuse(features), input_ids, positions, mask, None)) for h in (one, three)]
    torch.testing.assert_close(drafted[1], drafted[0], rtol=1e-5, atol=1e-5)
    for layer in three.layers:
        assert torch.count_nonzero(layer.self_attn.o_proj.weight) == 0
        assert torch.count_nonzero(layer.mlp.down_proj.weight) == 0
        assert torch.count_nonzero(layer.self_attn.q_proj.weight) > 0
        assert torch.count_nonzero(layer.mlp.up_proj.weight) > 0

    optimizer = torch.optim.SGD(three.parameters(), lr=0.1)
    for _ in range(2):  # step 1 moves the zero outputs; step 2 then reaches q/k/v and gate/up
        optimizer.zero_grad()
        three.logits(
            three.step(three.fuse(features), input_ids, positions, mask, None)
        ).square().mean().backward()
        optimizer.step()
    assert all(layer.self_attn.q_proj.weight.grad.abs().sum() > 0 for layer in three.layers)
    assert all(layer.mlp.up_proj.weight.grad.abs().sum() > 0 for layer in three.layers)

    with pytest.raises(ConfigError, match="saved head has 3 draft layers.*num_layers is 1.*not shrink"):
        build_head(tiny_llama, Eagle3Config(**settings, intermediate_size=width)).load_saved(three)


def test_grow_draft_vocabulary_keeps_the_saved_rows_and_adds_the_most_frequent_ids(monkeypatch):
    """Saved rows that are an exact linear map of the base's: without the ridge the added ids' rows
    follow the same map, a known answer for the fit; with it they shrink toward zero."""
    generator = torch.Generator().manual_seed(0)
    base_rows = torch.randn(40, 6, generator=generator)
    true_map = torch.randn(6, 6, generator=generator)
    saved_ids = torch.tensor([1, 4, 7, 9, 12, 15, 20, 22, 30, 33])
    counts = torch.zeros(40, dtype=torch.long)
    counts[[5, 4, 38, 2, 11]] = torch.tensor([50, 40, 30, 20, 20])  # 4 is saved; 2 and 11 tie
    saved_rows = base_rows[saved_ids] @ true_map
    ridged_ids, ridged = grow_draft_vocabulary(saved_ids, saved_rows, base_rows, counts, 14)
    monkeypatch.setattr(eagle3_module, "GROWTH_RIDGE", 0.0)
    ids, rows = grow_draft_vocabulary(saved_ids, saved_rows, base_rows, counts, 14)
    assert ids.tolist() == ridged_ids.tolist() == sorted([*saved_ids.tolist(), 5, 38, 2, 11])
    torch.testing.assert_close(rows, base_rows[ids] @ true_map, rtol=1e-4, atol=1e-4)
    kept = torch.isin(ids, saved_ids)
    assert torch.equal(rows[kept], saved_rows) and torch.equal(
        ridged[kept], saved_rows
    )  # copied, not refitted
    assert ridged[~kept].norm() < rows[~kept].norm()
    with pytest.raises(ValueError, match="cannot grow a 10-id draft vocabulary to 8 ids of 40"):
        grow_draft_vocabulary(saved_ids, base_rows[saved_ids], base_rows, counts, 8)


def test_a_saved_head_grows_into_a_larger_draft_vocabulary(tiny_llama):
    """The grown head drafts the saved ids with the saved logits (the rows are kept; only the
    softmax gains ids); a smaller vocabulary, or growth without token counts, is refused."""
    small = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=32))
    counts = torch.arange(256, 0, -1)  # id 0 most frequent
    small.init_from_data(counts.roll(100))  # saved vocabulary: ids 100-131
    with torch.no_grad():
        small.lm_head.weight.add_(
            torch.randn(small.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
        )
    large = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=48))
    large.load_saved(small, counts)
    target_ids = large.draft_to_target(torch.arange(48))
    assert target_ids.tolist() == list(range(16)) + list(range(100, 132))
    assert torch.equal(large.t2d.nonzero().flatten(), target_ids)
    features = torch.randn(1, 5, 3 * 64, generator=torch.Generator().manual_seed(2))
    input_ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(5)[None]
    mask = prefix_causal_mask(1, 0, 5, torch.float32, input_ids.device)
    with torch.no_grad():
        logits = [
            h.logits(h.step(h.fuse(features), input_ids, positions, mask, None)) for h in (small, large)
        ]
    torch.testing.assert_close(logits[1][..., 16:], logits[0])

    with pytest.raises(ConfigError, match="draft vocabulary has 48 ids.*draft_vocab_size is 32.*not shrink"):
        small.load_saved(large, counts)
    with pytest.raises(ConfigError, match="growing the draft vocabulary from 32 to 48 ids needs"):
        large.load_saved(small)


def eagle31_head(tiny_llama, **flags):
    torch.manual_seed(0)
    head = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, **flags))
    move_norms_off_unit_weight(head, seed=2)
    return head.eval()


def test_fc_norm_fuses_each_captured_layer_at_one_scale(tiny_llama):
    """With fc_norm, scaling one captured layer's state leaves g unchanged (each chunk is
    RMS-normalised before fc); without it, g moves (the control). Its norms are saved per layer."""
    features = torch.randn(2, 5, 3 * 64, generator=torch.Generator().manual_seed(4))
    scaled = features.clone()
    scaled[..., 64:128] *= 40.0  # the middle layer's state, as a deep layer's outliers would be
    normed, plain = eagle31_head(tiny_llama, fc_norm=True), eagle31_head(tiny_llama)
    with torch.no_grad():
        torch.testing.assert_close(normed.fuse(scaled), normed.fuse(features), rtol=1e-4, atol=1e-4)
        assert (plain.fuse(scaled) - plain.fuse(features)).abs().max() > 1.0
    names = {name for name in normed.state_dict() if name.startswith("fc_norm.")}
    assert names == {f"fc_norm.{index}.weight" for index in range(3)}
    assert not any(name.startswith("fc_norm.") for name in plain.state_dict())


def test_norm_output_hands_on_the_normed_state(tiny_llama):
    """With norm_output, a step returns norm(state) and lm_head reads it as is, so the logits are
    the same function of the layer's output as without it; only the state fed back differs."""
    features, input_ids, positions, mask = one_step_inputs()
    normed, plain = eagle31_head(tiny_llama, norm_output=True), eagle31_head(tiny_llama)
    normed.load_state_dict(plain.state_dict())
    with torch.no_grad():
        raw = plain.step(plain.fuse(features), input_ids, positions, mask, None)
        state = normed.step(normed.fuse(features), input_ids, positions, mask, None)
        torch.testing.assert_close(state, plain.norm(raw))
        torch.testing.assert_close(normed.logits(state), plain.logits(raw))
        assert (state - raw).abs().max() > 1e-3
