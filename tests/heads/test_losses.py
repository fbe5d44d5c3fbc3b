"""The loss functions: masking, weights, and their minima."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftheads.train.losses import (
    EAGLE3_STEP_LOSSES,
    acceptance_rate,
    cross_entropy,
    eagle3_loss,
    eagle3_step_loss,
    eagle3_targets,
    eagle_loss,
    hass_loss,
    kl_acceptance_loss,
    log_acceptance_loss,
    masked_mean,
    medusa_loss,
    mtp_loss,
    soft_cross_entropy,
    top_k_cross_entropy,
)


def test_masked_mean_ignores_masked_positions_and_survives_an_empty_mask():
    values = torch.tensor([[1.0, 100.0], [3.0, 100.0]])
    assert masked_mean(values, torch.tensor([[1, 0], [1, 0]])).item() == 2.0
    empty = masked_mean(values.requires_grad_(), torch.zeros(2, 2))
    assert empty.item() == 0.0 and empty.requires_grad


def test_cross_entropy_matches_torch():
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), reduction="none").reshape(3, 5)
    torch.testing.assert_close(cross_entropy(logits, targets), expected)
    # a one-hot soft target is the hard CE
    torch.testing.assert_close(soft_cross_entropy(F.one_hot(targets, 11).float(), logits), expected)


def test_medusa_loss_decays_by_head():
    head_losses = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)]
    torch.testing.assert_close(medusa_loss(head_losses), torch.tensor(1.0 + 0.8 * 2.0 + 0.64 * 4.0))


def test_eagle_loss_is_zero_regression_plus_entropy_at_the_target():
    features = torch.randn(5, 8)
    lm_head = torch.randn(13, 8)
    logits = features @ lm_head.T
    mask = torch.ones(5)
    entropy = -(F.softmax(logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()
    torch.testing.assert_close(eagle_loss(features, features, logits, logits, mask), 0.1 * entropy)
    off = features + 1.0  # SmoothL1 of a difference of 1 is 0.5 per element
    loss = eagle_loss(off, features, logits, logits, mask, probability_weight=0.0)
    torch.testing.assert_close(loss, torch.tensor(0.5))


def test_eagle3_targets_restrict_and_renormalise_over_the_draft_vocab():
    t2d = torch.tensor([True, False, True, True, False])
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.0], [3.0, 0.0, 1.0, 0.0, 0.0]])
    probs, usable = eagle3_targets(logits[:, t2d], logits.argmax(-1), t2d)
    torch.testing.assert_close(probs, F.softmax(logits[:, [0, 2, 3]], -1))
    assert usable.tolist() == [False, True]  # row 0's argmax (id 1) is not a draft token


def test_eagle3_loss_weights_steps():
    probs = [F.softmax(torch.randn(4, 6), -1) for _ in range(3)]
    logits = [torch.randn(4, 6) for _ in range(3)]
    mask = torch.tensor([True, True, True, False])
    expected = sum(0.8**j * soft_cross_entropy(probs[j], logits[j])[:3].mean() for j in range(3))
    step_loss = eagle3_step_loss()
    torch.testing.assert_close(
        eagle3_loss([step_loss(probs[j], logits[j], mask) for j in range(3)]), expected
    )


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_eagle3_loss_mixes_in_the_cross_entropy_on_the_argmax(weight):
    probs = F.softmax(torch.randn(4, 6), -1)
    logits = torch.randn(4, 6)
    mask = torch.tensor([True, False, True, True])
    expected = (
        (1 - weight) * soft_cross_entropy(probs, logits) + weight * cross_entropy(logits, probs.argmax(-1))
    )[[0, 2, 3]].mean()
    torch.testing.assert_close(eagle3_step_loss(hard_target_weight=weight)(probs, logits, mask), expected)


def test_eagle3_hard_targets_are_minimised_by_the_argmax_alone():
    """Logits that put all mass on the base's argmax: the hard loss goes to 0, the soft loss stays
    at least the target's entropy (the draft is penalised for not hedging as the base does)."""
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    sharp = torch.tensor([[50.0, 0.0, 0.0]])
    mask = torch.tensor([True])
    assert eagle3_step_loss(hard_target_weight=1.0)(probs, sharp, mask).item() < 1e-6
    entropy = -(probs * probs.log()).sum()
    assert eagle3_step_loss(hard_target_weight=0.0)(probs, sharp, mask).item() > entropy.item()


def test_acceptance_rate_is_one_minus_total_variation():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    q_logits = torch.tensor([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]]).log()
    alpha = acceptance_rate(p, q_logits)
    torch.testing.assert_close(alpha, 1 - 0.5 * (p - q_logits.exp()).abs().sum(-1))
    torch.testing.assert_close(alpha, torch.tensor([0.7, 0.0]))


def test_acceptance_objectives_reach_their_optimum_at_the_target():
    """At q = p: log_acceptance is 0 (alpha = 1) and kl_acceptance is 0; a draft that moves mass
    off the target scores worse under each, and a position at alpha = 0 adds 0 to -log alpha."""
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    mask = torch.tensor([True, True])
    for name in ("log_acceptance", "kl_acceptance"):
        loss = EAGLE3_STEP_LOSSES[name]
        assert loss(p, p.log(), mask).abs().item() < 1e-6, name
        assert loss(p, torch.tensor([[0.0, 0.0, 3.0], [3.0, 0.0, 0.0]]), mask).item() > 0.1, name
    disjoint = torch.tensor([[1.0, 0.0, 0.0]])
    assert log_acceptance_loss(disjoint, torch.tensor([[-1e4, 0.0, 0.0]]), torch.tensor([True])).item() == 0.0


def test_log_acceptance_gradient_raises_alpha():
    p = torch.tensor([[0.7, 0.2, 0.1]])
    logits = torch.zeros(1, 3, requires_grad=True)
    before = acceptance_rate(p, logits).item()
    log_acceptance_loss(p, logits, torch.tensor([True])).backward()
    after = acceptance_rate(p, logits.detach() - 0.5 * logits.grad).item()
    assert after > before


def test_kl_acceptance_weighs_kl_by_the_batch_acceptance():
    p = torch.tensor([[0.6, 0.3, 0.1]])
    logits = torch.tensor([[0.0, 1.0, 0.0]])
    mask = torch.tensor([True])
    alpha = acceptance_rate(p, logits)[0]
    kl = (p * (p.log() - F.log_softmax(logits, -1))).sum()
    weight = torch.exp(-alpha)
    torch.testing.assert_close(kl_acceptance_loss(p, logits, mask), weight * kl + (1 - weight) * (1 - alpha))


def test_eagle3_step_loss_takes_the_objective_by_name_and_refuses_mixes():
    probs, logits = F.softmax(torch.randn(4, 6), -1), torch.randn(4, 6)
    mask = torch.tensor([True, True, False, True])
    expected = log_acceptance_loss(probs, logits, mask)
    torch.testing.assert_close(eagle3_step_loss("log_acceptance")(probs, logits, mask), expected)
    with pytest.raises(ValueError, match="objective must be one of"):
        eagle3_step_loss("lk")
    with pytest.raises(ValueError, match="hard_target_weight applies to the soft_ce objective"):
        eagle3_step_loss("kl_acceptance", hard_target_weight=0.5)


def test_hass_counts_the_base_top_k_twice():
    """HASS's loss is softCE + w * the CE on the base's top-k tokens: its terms outside the top k
    are the soft CE's, so moving the draft's mass among those tokens changes the two equally."""
    p = torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]])
    logits = torch.tensor([[0.1, -0.3, 0.2, 0.4, -0.1]])
    mask = torch.tensor([True])
    log_q = F.log_softmax(logits, -1)
    top_two = -(p[0, :2] * log_q[0, :2]).sum()
    torch.testing.assert_close(top_k_cross_entropy(p, log_q, k=2)[0], top_two)
    torch.testing.assert_close(top_k_cross_entropy(p, log_q, k=99), soft_cross_entropy(p, logits))
    expected = soft_cross_entropy(p, logits)[0] + 0.5 * top_two
    torch.testing.assert_close(hass_loss(top_k=2, top_k_weight=0.5)(p, logits, mask), expected)
    # its gradient pulls harder on the top-k logits than the soft CE's (the harmonised objective)
    for loss, name in ((hass_loss(), "hass"), (EAGLE3_STEP_LOSSES["soft_ce"], "soft_ce")):
        leaf = logits.clone().requires_grad_()
        loss(p, leaf, mask).backward()
        if name == "hass":
            hass_grad = leaf.grad
        else:
            soft_grad = leaf.grad
    assert (hass_grad[0, :1] < soft_grad[0, :1]).all()  # a larger push up on the base's argmax


def test_mtp_loss_is_the_weighted_mean_over_modules():
    module_losses = [torch.tensor(math.log(10)), torch.tensor(2 * math.log(10))]
    assert mtp_loss(module_losses, weight=0.3).item() == pytest.approx(0.3 * 1.5 * math.log(10))
