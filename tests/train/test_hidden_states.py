"""The online source keeps only the base states a head reads, and they are the ones a full forward gives."""

from __future__ import annotations

import pytest
import torch

from draftheads.heads import Eagle3Config, MedusaConfig, build_head
from draftheads.train.hidden_states import OnlineHiddenStates
from draftheads.train.objective import compute_objective

HEADS = {
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2),
    "medusa": MedusaConfig(num_heads=2, num_layers=1),
}


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_the_online_source_keeps_only_the_required_states(tiny_llama, kind):
    head = build_head(tiny_llama, HEADS[kind])
    input_ids = torch.randint(3, 256, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    required = tuple(head.required_hidden_states)
    kept = OnlineHiddenStates(tiny_llama, required)(batch, "train")
    every = OnlineHiddenStates(tiny_llama)(batch, "train")
    assert len(kept) == len(every) == tiny_llama.config.num_hidden_layers + 1
    assert [index for index, state in enumerate(kept) if state is not None] == list(required)
    for index in required:
        torch.testing.assert_close(kept[index], every[index], rtol=0, atol=0)
    loss_mask = attention_mask.clone()
    loss_mask[:, :2] = 0
    with torch.random.fork_rng():
        torch.manual_seed(0)
        from_kept = compute_objective(head, kept, input_ids, loss_mask, attention_mask).loss
    with torch.random.fork_rng():
        torch.manual_seed(0)
        from_every = compute_objective(head, every, input_ids, loss_mask, attention_mask).loss
    torch.testing.assert_close(from_kept, from_every, rtol=0, atol=0)
