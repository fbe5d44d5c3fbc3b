"""DFlash heads: config checks, anchors, the training blocks equal to drafting's blocks, the attention
pattern (context before the anchor only, bidirectional within a block), the objective's
bookkeeping and that it learns, save/load."""

from __future__ import annotations

import math

import pytest
import torch
from head_fixtures import base_hidden_states, batch, make_tiny_llama  # noqa: F401

from draftheads.heads import DFlashConfig, build_head, load_head
from draftheads.heads.dflash import block_position_weights, choose_anchors, default_feature_layers
from draftheads.settings import ConfigError
from draftheads.train.objective import compute_objective

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = DFlashConfig(num_layers=2, block_size=4, feature_layers=(1, 2, 3))


@pytest.fixture
def model():
    return make_tiny_llama()


@pytest.fixture
def head(model):
    torch.manual_seed(0)
    return build_head(model, CONFIG).eval()


def sequence(length: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


# ---- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("num_layers", 0, "num_layers"),
        ("block_size", 1, "block_size"),
        ("feature_layers", (1, 1), "feature_layers"),
        ("mask_token_id", -1, "mask_token_id"),
        ("anchors_per_sequence", 0, "anchors_per_sequence"),
        ("loss_decay", 0.0, "loss_decay"),
        ("layer_architecture", "mistral", "layer_architecture"),
    ],
)
def test_bad_config_values_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**{field: value})


def test_default_feature_layers_follow_the_releases():
    # Qwen3-8B (36 layers), 5 draft layers: outputs of layers 1, 9, 17, 25, 33 = indices + 1.
    assert default_feature_layers(36, 5) == (2, 10, 18, 26, 34)
    assert len(default_feature_layers(24, 1)) == 3  # at least three, as EAGLE-3


def test_out_of_range_layers_and_mask_token_are_refused(model):
    with pytest.raises(ConfigError, match="feature_layers"):
        build_head(model, DFlashConfig(feature_layers=(1, 9)))
    with pytest.raises(ConfigError, match="duplicate"):
        build_head(model, DFlashConfig())  # the default repeats a layer of a 4-layer base
    with pytest.raises(ConfigError, match="mask_token_id=256"):
        build_head(model, DFlashConfig(feature_layers=(1, 2, 3), mask_token_id=256))


def test_block_position_weights_decay():
    weights = block_position_weights(16, 7.0)
    assert len(weights) == 15 and weights[0] == 1.0
    assert weights[7] == pytest.approx(1 / math.e)
    assert block_position_weights(4, None) == [1.0, 1.0, 1.0]


# ---- anchors ------------------------------------------------------------------------------------


def test_random_anchors_are_distinct_candidates_in_order():
    candidates = torch.zeros(2, 20, dtype=torch.bool)
    candidates[0, 3:15] = True
    candidates[1, [4, 9]] = True
    priority = torch.rand(2, 20, generator=torch.Generator().manual_seed(0))  # (B, T)
    anchors, valid = choose_anchors(candidates, 5, priority)
    assert anchors.shape == valid.shape == (2, 5)
    assert valid[0].all() and valid[1].tolist() == [True, True, False, False, False]
    assert anchors[1, :2].tolist() == [4, 9]
    row = anchors[0].tolist()
    assert row == sorted(set(row)) and all(candidates[0, a] for a in row)


def test_evaluation_anchors_are_deterministic_and_evenly_spaced():
    candidates = torch.zeros(1, 40, dtype=torch.bool)
    candidates[0, 10:30] = True
    anchors, valid = choose_anchors(candidates, 4)
    assert valid.all() and anchors.tolist() == [[10, 15, 20, 25]]
    assert choose_anchors(candidates, 100)[0].tolist() == [list(range(10, 30))]


# ---- the block ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_architecture", [None, "qwen3"])
def test_training_blocks_equal_drafting_blocks(model, layer_architecture):
    """Row k of a training block at anchor a gives the logits the drafter gets at root position a
    from a cache filled over several calls (base Llama layers, and Qwen3 layers on a Llama base)."""
    torch.manual_seed(0)
    config = DFlashConfig(
        num_layers=2, block_size=4, feature_layers=(1, 2, 3), layer_architecture=layer_architecture
    )
    head = build_head(model, config).eval()
    if layer_architecture == "qwen3":
        assert "layers.0.self_attn.q_norm.weight" in head.head_state_dict()
    input_ids = sequence()
    features = head.select_features(base_hidden_states(model, input_ids))
    anchors, valid = torch.tensor([[5, 9, 12]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        trained = head.logits(head.training_blocks(features, input_ids, None, anchors, valid))  # (1, 3, K, V)
        cache, start = head.new_cache(), 0
        for block, anchor in enumerate(anchors[0].tolist()):
            drafted = head.draft_block(cache, features[:, start:anchor], anchor, input_ids[:, anchor])
            torch.testing.assert_close(drafted, trained[:, block, 1:], atol=1e-5, rtol=1e-5)
            start = anchor
        assert cache.get_seq_length() == 12


def test_a_block_reads_context_before_its_anchor_only(model, head):
    input_ids = sequence()
    features = head.select_features(base_hidden_states(model, input_ids))
    anchor = 7
    changed = features.clone()
    changed[:, anchor:] += 1.0  # the anchor's own features and later: unseen
    with torch.no_grad():
        reference = head.draft_block(head.new_cache(), features[:, :anchor], anchor, input_ids[:, anchor])
        later = head.training_blocks(
            changed, input_ids, None, torch.tensor([[anchor]]), torch.ones(1, 1).bool()
        )
        torch.testing.assert_close(head.logits(later[:, 0, 1:]), reference, atol=1e-5, rtol=1e-5)
        changed[:, anchor - 1] += 1.0  # the last context row: seen
        moved = head.draft_block(head.new_cache(), changed[:, :anchor], anchor, input_ids[:, anchor])
    assert not torch.allclose(moved, reference)


def test_rows_attend_both_ways_within_a_block(model, head):
    """Row 1's output depends on the rows after it: with the mask token changed only at the later
    rows (through a different embedding), row 1 moves."""
    input_ids = sequence()
    features = head.select_features(base_hidden_states(model, input_ids))
    with torch.no_grad():
        block = head.block_embeddings(input_ids[:, 6], 1)  # (1, K, h)
        context = head.context(features[:, :6])
        positions = torch.arange(0, 6 + head.block_size)[None]
        mask = torch.zeros(1, 1, 6 + head.block_size, 6 + head.block_size)
        reference = head.denoise(context, block, positions, mask)
        block[:, 2:] += 1.0
        moved = head.denoise(context, block, positions, mask)
    assert not torch.allclose(moved[:, 1], reference[:, 1])


# ---- the objective ------------------------------------------------------------------------------


def test_objective_counts_each_block_row(model, head, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    hidden_states = base_hidden_states(model, input_ids, attention_mask)
    output = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    # Supervised: row 0 positions 4..15, row 1 4..12; anchors a >= 3 with t_{a+1} supervised, and
    # block row k counts t_{a+k} when supervised: 12 + 9, then 11 + 8, then 10 + 7.
    assert output.counted.tolist() == [21.0, 19.0, 17.0]
    assert output.loss.requires_grad and bool((output.top1_correct <= output.top5_correct).all())


def test_top1_is_scored_against_the_data_token(model, head):
    input_ids = sequence(12)
    loss_mask = torch.ones_like(input_ids)
    hidden_states = base_hidden_states(model, input_ids)
    output = compute_objective(head, hidden_states, input_ids, loss_mask, None)
    anchors = torch.arange(1, 11)[None]
    with torch.no_grad():
        logits = head.logits(
            head.training_blocks(head.select_features(hidden_states), input_ids, None, anchors, anchors > 0)
        )  # (1, 10, K, V)
    for row in range(1, head.block_size):
        kept = anchors[0] + row < 12
        hits = logits[0, kept, row].argmax(-1) == input_ids[0, anchors[0, kept] + row]
        assert output.top1_correct[row - 1].item() == hits.sum().item()


def test_training_anchors_follow_the_sample_seed(model, head, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    hidden_states = base_hidden_states(model, input_ids, attention_mask)
    head.config.anchors_per_sequence = 3
    head.train()
    first = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, sample_seed=5)
    again = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, sample_seed=5)
    other = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, sample_seed=6)
    torch.testing.assert_close(first.loss, again.loss)
    assert first.counted[0] == 6  # 3 anchors in each row
    assert not torch.equal(first.loss, other.loss)


def test_objective_learns_a_fixed_batch(model, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    torch.manual_seed(0)
    head = build_head(model, CONFIG).train()
    hidden_states = base_hidden_states(model, input_ids, attention_mask)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-2)
    losses = []
    for step in range(60):
        output = compute_objective(
            head, hidden_states, input_ids, loss_mask, attention_mask, sample_seed=step
        )
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    assert losses[-1] < 0.75 * losses[0], losses[::10]  # random tokens: memorised slowly
    assert not any(p.grad is not None for p in model.parameters())  # the base stays frozen


# ---- persistence --------------------------------------------------------------------------------


def test_save_and_load_round_trip(model, head, tmp_path):
    head.save_pretrained(tmp_path / "dflash")
    loaded = load_head(tmp_path / "dflash", base_model=model)
    assert loaded.kind == "dflash" and loaded.config == head.config
    assert set(loaded.head_state_dict()) == set(head.head_state_dict())
    assert not any("embed" in name or "lm_head" in name for name in head.head_state_dict())
    input_ids = sequence()
    features = head.select_features(base_hidden_states(model, input_ids))
    with torch.no_grad():
        expected = head.draft_block(head.new_cache(), features[:, :8], 8, input_ids[:, 8])
        actual = loaded.draft_block(loaded.new_cache(), features[:, :8], 8, input_ids[:, 8])
    torch.testing.assert_close(actual, expected)


def test_base_targets_score_against_the_base_argmax(model):
    torch.manual_seed(0)
    head = build_head(
        model, DFlashConfig(num_layers=1, block_size=3, feature_layers=(1, 2, 3), targets="base")
    )
    input_ids = sequence(12)
    hidden_states = base_hidden_states(model, input_ids)
    greedy = model.lm_head(hidden_states[-1]).argmax(-1)  # (1, T): the base's token after each position
    output = compute_objective(head, hidden_states, input_ids, torch.ones_like(input_ids), None)
    anchors = torch.arange(1, 11)[None]
    with torch.no_grad():
        states = head.training_blocks(
            head.select_features(hidden_states), input_ids, None, anchors, anchors > 0
        )
    predicted = head.logits(states[0, :, 1]).argmax(-1)  # (10,) row 1 predicts position a + 1
    assert output.top1_correct[0].item() == (predicted == greedy[0, 1:11]).sum().item()
    with pytest.raises(ValueError, match="targets"):
        DFlashConfig(targets="teacher")


def test_the_final_norm_starts_at_the_bases(model):
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    head = build_head(model, CONFIG)
    torch.testing.assert_close(head.norm.weight, model.model.norm.weight)
