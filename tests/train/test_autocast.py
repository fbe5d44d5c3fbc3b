"""train.autocast: the head's training forward runs its matmuls in bf16; the base's forward, the
targets it gives (its lm_head) and evaluation stay in the weights' fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftheads.heads import Eagle3Config, MedusaConfig, build_head
from draftheads.train.batching import fixed_batches
from draftheads.train.hidden_states import OnlineHiddenStates
from draftheads.train.recipe import FrozenBaseRecipe
from tests.train.tiny_runs import patterned_dataset


def _linear_output_dtypes(module: nn.Module, seen: set) -> list:
    def record(_module, _inputs, output):
        seen.add(output.dtype)

    return [m.register_forward_hook(record) for m in module.modules() if isinstance(m, nn.Linear)]


EAGLE3 = Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2)


@pytest.mark.parametrize("config", [EAGLE3, MedusaConfig(num_heads=2)])
def test_training_forward_autocasts_the_head_only(tiny_llama, config):
    torch.manual_seed(0)
    head = build_head(tiny_llama, config)
    recipe = FrozenBaseRecipe(head, OnlineHiddenStates(tiny_llama), autocast=torch.bfloat16)
    batch = next(iter(fixed_batches(patterned_dataset(4), 4, 0, seed=0)))
    batch["sample_seed"] = 0
    head_dtypes, base_dtypes = set(), set()
    hooks = _linear_output_dtypes(head, head_dtypes) + _linear_output_dtypes(tiny_llama, base_dtypes)
    try:
        output = recipe(batch, "train")
        assert head_dtypes == {torch.bfloat16} and base_dtypes == {torch.float32}
        assert output.loss.dtype == torch.float32 and torch.isfinite(output.loss)
        output.loss.backward()
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in head.parameters())

        head_dtypes.clear()
        with torch.no_grad():
            recipe(batch, "validation")  # evaluation computes as decoding does
        assert head_dtypes == {torch.float32}

        head_dtypes.clear()
        FrozenBaseRecipe(head, OnlineHiddenStates(tiny_llama))(batch, "train")
        assert head_dtypes == {torch.float32}  # the default: no autocast
    finally:
        for hook in hooks:
            hook.remove()
