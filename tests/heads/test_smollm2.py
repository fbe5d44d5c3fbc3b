"""Every head kind with its defaults on the real SmolLM2-135M (30 layers, vocab 49,152)."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import base_hidden_states, token_counts

from draftheads.heads import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.train.objective import compute_objective

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "config", [MedusaConfig(), EagleConfig(), Eagle3Config(ttt_steps=2), MtpConfig()], ids=lambda c: c.kind
)
def test_default_head_trains_a_step_on_smollm2(config, smollm2):
    model, tokenizer = smollm2
    input_ids = tokenizer(
        "The capital of France is Paris. The capital of Italy is Rome.", return_tensors="pt"
    ).input_ids
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0
    head = build_head(model, config, base_name="smollm2-135m-instruct")
    head.init_from_data(token_counts(input_ids, model.config.vocab_size))
    if config.kind == "eagle3":
        assert head.feature_layers == (2, 15, 27) and head.draft_vocab_size == 32000
    head.train()
    hidden_states = base_hidden_states(model, input_ids)
    output = compute_objective(head, hidden_states, input_ids, loss_mask, torch.ones_like(input_ids))
    assert torch.isfinite(output.loss)
    output.loss.backward()
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert not any(p.grad is not None for p in model.parameters())  # the base stays frozen
