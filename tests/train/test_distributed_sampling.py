"""A training batch's random draws (loss_token_fraction's sample, EAGLE's feature noise, Medusa-2's
LoRA dropout) come from the batch's own row seeds, never from the process's RNG stream: what a run
learns must not depend on how many data-parallel processes ran it."""

from __future__ import annotations

import pytest
import torch

from draftheads.config import JointConfig
from draftheads.heads import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.train.draws import row_seeds
from draftheads.train.joint import JointRecipe, add_lora_adapter
from draftheads.train.objective import compute_objective
from tests.conftest import make_tiny_llama

HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=2),
    "eagle": EagleConfig(feature_noise=0.1),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2),
    "mtp": MtpConfig(num_modules=2),
}


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (2, 24), generator=generator)  # (B, T)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0
    return input_ids, loss_mask, torch.ones_like(input_ids)


def test_row_seeds_differ_by_seed_epoch_and_row():
    seeds = torch.cat([row_seeds(s, e, range(40)) for s in range(3) for e in range(5)]).tolist()
    assert len(set(seeds)) == 3 * 5 * 40
    assert torch.equal(row_seeds(7, 3, [1, 2]), row_seeds(7, 3, torch.tensor([1, 2])))
    assert all(0 <= seed < 2**32 for seed in seeds)


@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_the_sample_depends_on_the_batch_seed_not_the_global_rng(kind):
    base = make_tiny_llama()
    head = build_head(base, HEAD_CONFIGS[kind]).train()
    input_ids, loss_mask, attention_mask = _batch()
    with torch.no_grad():
        hidden_states = base.model(input_ids, output_hidden_states=True).hidden_states

    def loss(global_seed: int, sample_seed: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(global_seed)  # another process's stream position
        with torch.no_grad():
            output = compute_objective(
                head, hidden_states, input_ids, loss_mask, attention_mask, 0.25, sample_seed
            )
        return output.loss, output.counted

    reference, counted = loss(0, sample_seed=row_seeds(11, 0, [0, 1]))
    again, counted_again = loss(12345, sample_seed=row_seeds(11, 0, [0, 1]))
    assert torch.equal(again, reference) and torch.equal(counted_again, counted)
    other, other_counted = loss(0, sample_seed=row_seeds(12, 0, [0, 1]))
    assert not torch.equal(other, reference)
    assert not torch.equal(other_counted, counted) or kind == "eagle"  # eagle: the noise differs


def test_medusa2_lora_dropout_follows_the_batch_seed():
    base = make_tiny_llama()
    head = build_head(base, MedusaConfig(num_heads=2, joint=True))
    joint = JointConfig(lora_rank=4, lora_dropout=0.5, base_loss="lm")
    recipe = JointRecipe(add_lora_adapter(base, joint), head, joint).train()
    with torch.no_grad():  # LoRA B starts at zero, which would hide the dropout
        for name, parameter in recipe.adapted_base.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    input_ids, loss_mask, attention_mask = _batch()
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}

    def base_loss(global_seed: int, sample_seed: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(global_seed)
        with torch.no_grad():
            return recipe({**batch, "sample_seed": sample_seed}, "train").loss_parts["base_loss"]

    seeds, other = row_seeds(5, 0, [0, 1]), row_seeds(6, 0, [0, 1])
    assert torch.equal(base_loss(0, seeds), base_loss(99, seeds))
    assert not torch.equal(base_loss(0, seeds), base_loss(0, other))
