"""compute_objective: alignment, accuracy bookkeeping, and that each kind can learn a fixed batch."""

from __future__ import annotations

import pytest
import torch
from head_fixtures import HEAD_CONFIGS, KINDS, base_hidden_states, batch, make_tiny_llama, token_counts  # noqa: F401

from draftheads.heads import MedusaConfig, build_head
from draftheads.train.objective import OBJECTIVES, ObjectiveOutput, compute_objective


@pytest.fixture
def sharp_llama():
    """The tiny Llama with a scaled-up lm_head: a random model's next-token distributions are
    nearly uniform, which leaves soft-target losses (EAGLE, EAGLE-3) almost nothing to learn."""
    model = make_tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def test_every_registered_kind_has_an_objective():
    from draftheads.heads import HEAD_REGISTRY

    assert set(OBJECTIVES) == set(HEAD_REGISTRY)


@pytest.mark.parametrize("kind", KINDS)
def test_output_shapes_and_counts(kind, tiny_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS[kind])
    output = compute_objective(
        head, base_hidden_states(tiny_llama, input_ids, attention_mask), input_ids, loss_mask, attention_mask
    )
    assert isinstance(output, ObjectiveOutput)
    steps = {"medusa": 3, "eagle": 1, "eagle3": 3, "mtp": 3, "peagle": 3}[kind]
    assert output.loss.dim() == 0 and output.loss.requires_grad
    assert output.top1_correct.shape == output.top5_correct.shape == output.counted.shape == (steps,)
    assert bool((output.top1_correct <= output.top5_correct).all())
    assert bool((output.top5_correct <= output.counted).all())
    # Supervised tokens: row 0 positions 4..15, row 1 positions 4..12. Step s predicts token q from
    # row q - (s + 2) >= 0, so every supervised token (q >= 4) is counted up to step 2.
    assert output.counted.tolist() == [12.0 + 9.0] * steps


def test_a_dict_of_hidden_states_works_like_the_tuple(tiny_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS["eagle3"])
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    subset = {index: hidden_states[index] for index in head.required_hidden_states}
    from_tuple = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    from_dict = compute_objective(head, subset, input_ids, loss_mask, attention_mask)
    torch.testing.assert_close(from_dict.loss, from_tuple.loss)


def test_medusa_head_k_is_scored_against_the_token_k_plus_2_ahead(tiny_llama):
    """A head whose own lm_head is the base one scores, for head k, the base top-1 vs token t+k+2."""
    input_ids = torch.randint(3, 256, (1, 12))
    loss_mask = torch.ones_like(input_ids)
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=0))
    hidden_states = base_hidden_states(tiny_llama, input_ids)
    predicted = tiny_llama.lm_head(hidden_states[-1]).argmax(-1)[0]  # (T,)
    output = compute_objective(head, hidden_states, input_ids, loss_mask, None)
    for k in range(2):
        expected = (predicted[: 12 - k - 2] == input_ids[0, k + 2 :]).sum().item()
        assert output.top1_correct[k].item() == expected
        assert output.counted[k].item() == 12 - k - 2


def test_padding_and_prompt_tokens_do_not_change_the_loss(tiny_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS["mtp"])
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    reference = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    changed = input_ids.clone()
    changed[1, 14:] = 7  # padding tokens (never attended, never targets)
    moved = compute_objective(head, hidden_states, changed, loss_mask, attention_mask)
    torch.testing.assert_close(moved.loss, reference.loss)


def test_eagle_noise_only_in_training_mode(tiny_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS["eagle"])
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    head.eval()
    first = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask).loss
    second = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask).loss
    assert torch.equal(first, second)
    head.train()
    noisy = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask).loss
    assert not torch.equal(noisy, first)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_falls_when_overfitting_a_fixed_batch(kind, sharp_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    torch.manual_seed(0)
    head = build_head(sharp_llama, HEAD_CONFIGS[kind])
    head.init_from_data(token_counts(input_ids[loss_mask.bool()], 256))
    head.train()
    hidden_states = base_hidden_states(sharp_llama, input_ids, attention_mask)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses, first = [], None
    for _ in range(60):
        output = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
        first = first or output
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(output.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
    assert output.top1_correct.sum() > first.top1_correct.sum()


@pytest.mark.parametrize("kind", KINDS)
def test_token_fraction_scores_a_subset_in_training_and_everything_in_eval(kind, tiny_llama, batch):  # noqa: F811
    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS[kind])
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    head.eval()
    everything = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    evaluated = compute_objective(
        head, hidden_states, input_ids, loss_mask, attention_mask, token_fraction=0.5
    )
    assert evaluated.counted.tolist() == everything.counted.tolist()
    torch.testing.assert_close(evaluated.loss, everything.loss)
    head.train()
    torch.manual_seed(0)
    sampled = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, token_fraction=0.5)
    assert bool((sampled.counted < everything.counted).all()) and bool((sampled.counted > 0).all())


def test_sample_keep_keeps_about_the_fraction():
    from draftheads.train.draws import row_seeds
    from draftheads.train.supervision import sample_keep

    loss_mask = torch.zeros(8, 1000, dtype=torch.long)
    loss_mask[:, 200:] = 1
    seeds = row_seeds(0, 0, range(8))
    keep = sample_keep(seeds, 1000, 0.25)
    kept = loss_mask * keep
    assert int(kept[:, :200].sum()) == 0
    assert abs(kept.sum().item() / loss_mask.sum().item() - 0.25) < 0.02
    # Each row keeps about the fraction too, and rows differ (each has its own seed).
    assert all(abs(row.item() / 800 - 0.25) < 0.06 for row in kept.sum(dim=1))
    assert len({tuple(row.tolist()) for row in keep}) == 8
    assert sample_keep(seeds, 1000, 1.0) is None


def test_eagle3_token_fraction_samples_whole_chains(tiny_llama, batch):  # noqa: F811
    """EAGLE-3 keeps a row's chain at every TTT step or at none: the step counts fall together."""
    from draftheads.train.draws import row_seeds
    from draftheads.train.supervision import sample_keep

    input_ids, loss_mask, attention_mask = batch
    head = build_head(tiny_llama, HEAD_CONFIGS["eagle3"])
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    head.eval()
    everything = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    head.train()
    seeds = row_seeds(0, 0, range(input_ids.shape[0]))
    keep = sample_keep(seeds, input_ids.shape[1], 0.5)
    sampled = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, 0.5, seeds)
    supervised = loss_mask.bool() & attention_mask.bool()
    expected = [
        int((keep[:, : -(2 + step)] & supervised[:, 2 + step :]).sum())
        for step in range(len(everything.counted))
    ]
    assert sampled.counted.tolist() == expected


def test_cod_chain_steps_follow_the_geometric_rates():
    """Step j is reached by about max(r^j, floor) of the rows, whatever the row's batch slot."""
    from draftheads.heads.eagle3 import Eagle3Config
    from draftheads.train.draws import row_seeds
    from draftheads.train.supervision import cod_chain_steps

    seeds = row_seeds(0, 0, range(4))
    config = Eagle3Config(ttt_steps=5, cod_ratio=0.7, cod_ratio_min=0.3)
    steps = cod_chain_steps(seeds, 5000, config)  # (4, 5000)
    assert int(steps.min()) == 1 and int(steps.max()) == 5
    for step, rate in zip(range(1, 5), (0.7, 0.49, 0.343, 0.3), strict=True):
        assert abs((steps > step).float().mean().item() - rate) < 0.015, step
    # A row's chain length is a function of its seed and position alone.
    assert torch.equal(cod_chain_steps(seeds[2:], 100, config), steps[2:, :100])


def test_cod_runs_fewer_chains_at_deeper_steps_in_training_only(tiny_llama, batch):  # noqa: F811
    """COD scores each step's chains as drawn, never a chain past the step it stops at; evaluation
    scores every chain at every step."""
    import dataclasses

    from draftheads.train.draws import row_seeds
    from draftheads.train.supervision import cod_chain_steps, sample_keep

    input_ids, loss_mask, attention_mask = batch
    config = dataclasses.replace(HEAD_CONFIGS["eagle3"], ttt_steps=3, cod_ratio=0.5, cod_ratio_min=0.0)
    head = build_head(tiny_llama, config)
    hidden_states = base_hidden_states(tiny_llama, input_ids, attention_mask)
    head.eval()
    everything = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask)
    full_chains = build_head(tiny_llama, dataclasses.replace(config, cod_ratio=1.0)).eval()
    full = compute_objective(full_chains, hidden_states, input_ids, loss_mask, attention_mask)
    assert everything.counted.tolist() == full.counted.tolist()
    head.train()
    seeds = row_seeds(0, 0, range(input_ids.shape[0]))
    sampled = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, 1.0, seeds)
    chain = cod_chain_steps(seeds, input_ids.shape[1], config)
    supervised = loss_mask.bool() & attention_mask.bool()
    expected = [
        int(((chain[:, : -(2 + step)] > step) & supervised[:, 2 + step :]).sum()) for step in range(3)
    ]
    assert sampled.counted.tolist() == expected
    assert expected[0] == everything.counted[0] and expected[2] < expected[1] < expected[0]
    assert torch.isfinite(sampled.loss)
    # With token sampling too, a step scores the chains both draws keep.
    keep = sample_keep(seeds, input_ids.shape[1], 0.5)
    both = compute_objective(head, hidden_states, input_ids, loss_mask, attention_mask, 0.5, seeds)
    expected = [
        int((keep[:, : -(2 + step)] & (chain[:, : -(2 + step)] > step) & supervised[:, 2 + step :]).sum())
        for step in range(3)
    ]
    assert both.counted.tolist() == expected and 0 < expected[2] < sampled.counted[2]
