"""P-EAGLE: its training-time test computes what one drafting forward computes, and its mask rows
ignore what the data (or a draft) holds at deeper depths."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import base_hidden_states

from draftheads.heads import Eagle3Config, PEagleConfig, build_head
from draftheads.heads.base import head_config_from_dict
from draftheads.infer.draft import drafter_for
from draftheads.settings import ConfigError

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def make_head(model, **overrides):
    torch.manual_seed(0)
    config = PEagleConfig(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3, **overrides)
    return build_head(model, config).eval()


@pytest.fixture
def sequence(tiny_llama):
    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    return input_ids, base_hidden_states(tiny_llama, input_ids)


@pytest.mark.parametrize("new,num_layers", [(1, 1), (3, 1), (3, 2)])
def test_training_time_test_equals_one_drafting_forward(tiny_llama, sequence, new, num_layers):
    """Step j at row i of the unroll is depth j + 1 of the forward whose last new row is i: the same
    prefix, mask rows and positions, whether the forward catches up on one row or several, in every
    draft layer."""
    input_ids, hidden_states = sequence
    head = make_head(tiny_llama, num_layers=num_layers)
    features = head.select_features(hidden_states)  # (2, 12, 3h)
    row = 6
    with torch.no_grad():
        states = head.training_time_test(features, input_ids, None).states  # 3 x (2, 12, h)
        cache = head.new_cache()
        start = row + 1 - new
        head.catch_up(
            cache, features[:, :start], input_ids[:, 1 : start + 1], torch.arange(start)[None].expand(2, -1)
        )
        logits = head.draft_chain(
            cache, features[:, start : row + 1], input_ids[:, start + 1 : row + 2], row + 1, 3
        )
    assert cache.get_seq_length() == row + 1  # mask rows cropped, the new rows kept
    for depth in range(3):
        torch.testing.assert_close(logits[:, depth], head.logits(states[depth][:, row]), **TOLERANCE)


def test_mask_rows_do_not_read_the_data_beyond_the_root(tiny_llama, sequence):
    """Steps >= 1 consume the mask row, not the data's tokens: changing the tokens after a row's
    root leaves its deeper states as they were (EAGLE-3's would move: the control)."""
    input_ids, hidden_states = sequence
    head = make_head(tiny_llama)
    features = head.select_features(hidden_states)
    changed = input_ids.clone()
    changed[:, 8:] = 3
    with torch.no_grad():
        before = head.training_time_test(features, input_ids, None).states
        after = head.training_time_test(features, changed, None).states
    torch.testing.assert_close(after[2][:, 5], before[2][:, 5])  # row 5's root is t_6: unchanged
    assert (after[0][:, 7] - before[0][:, 7]).abs().max() > 1e-4  # row 7 consumes t_8 itself
    eagle3 = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3))
    with torch.no_grad():  # the control: EAGLE-3's step 2 at row 5 consumes t_8
        moved = eagle3.training_time_test(features, changed, None).states[2][:, 5]
        kept = eagle3.training_time_test(features, input_ids, None).states[2][:, 5]
    assert (moved - kept).abs().max() > 1e-4


def test_drafter_refuses_a_root_that_is_not_the_committed_token(tiny_llama, sequence):
    input_ids, hidden_states = sequence
    head = make_head(tiny_llama)
    drafter = drafter_for(head)
    drafter.start(tuple(h[:1] for h in hidden_states), input_ids[:1], root=7)
    assert drafter.max_depth == 3
    with pytest.raises(ValueError, match="root 9 at position 12 is not the committed token 7"):
        drafter.path_candidates(9, 12, torch.tensor([], dtype=torch.long), 2)
    assert drafter.path_candidates(7, 12, torch.tensor([1, 2]), 2).shape == (3, 2)


def test_config_names_the_mask_token_and_the_kind(tiny_llama):
    config = head_config_from_dict({"kind": "peagle", "feature_layers": [1, 2, 3], "draft_vocab_size": 64})
    assert isinstance(config, PEagleConfig) and config.ttt_steps == 3
    assert make_head(tiny_llama).mask_token_id == 255
    with pytest.raises(ConfigError, match="head.mask_token_id=256 is outside the base vocab"):
        make_head(tiny_llama, mask_token_id=256)
    assert "mask_hidden" in make_head(tiny_llama).state_dict()
