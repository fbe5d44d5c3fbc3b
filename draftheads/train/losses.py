"""Training losses of the draft heads, as pure functions.

Each takes predictions and targets that are already aligned (``draftheads.train.objective`` does
the shifting: which position predicts which token) with any leading shape ``...``, and a mask of
that leading shape (1 = a supervised position, i.e. an assistant token).
A masked mean divides by the number of supervised positions, so padding and prompt tokens never
dilute a loss; a step with no supervised position contributes 0 (and still carries a gradient
path, so every rank can call backward). Logits are upcast to float32 before any softmax.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

MEDUSA_DECAY = 0.8  # w_k = 0.8^k for head k (Medusa paper, Medusa-1 training)
EAGLE_PROBABILITY_WEIGHT = 0.1  # weight of the soft CE next to the feature regression (EAGLE paper)
EAGLE3_DECAY = 0.8  # w_j = 0.8^j for training-time-test step j (EAGLE-3 training code)
# HASS's top-K distillation (Zhang et al. 2024, "Learning Harmonized Representations for
# Speculative Sampling", arXiv 2408.15766): its release trains with K = 10 at weight 1.0.
HASS_TOP_K = 10
HASS_TOP_K_WEIGHT = 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` (...) over positions where ``mask`` (...) is nonzero; 0 if there are none."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position CE: (..., V) logits, (...) target ids -> (...)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    return -log_probs.gather(-1, targets[..., None]).squeeze(-1)


def soft_cross_entropy(target_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position CE against a distribution: (..., V) target probabilities, (..., V) logits -> (...)."""
    return -(target_probs.float() * F.log_softmax(logits.float(), dim=-1)).sum(-1)


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_teacher || p_student): (..., V) logits each -> (...). Medusa-2's
    self-distillation base loss, the teacher being the base with its adapter disabled."""
    teacher_log_probs = F.log_softmax(teacher_logits.float(), dim=-1)  # (..., V)
    student_log_probs = F.log_softmax(student_logits.float(), dim=-1)  # (..., V)
    return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)


def medusa_loss(
    head_logits: Sequence[torch.Tensor],
    head_targets: Sequence[torch.Tensor],
    head_masks: Sequence[torch.Tensor],
    decay: float = MEDUSA_DECAY,
) -> torch.Tensor:
    """sum_k decay^k * CE_k (Medusa-1). Head k: logits (..., V) for the token k + 2 ahead, targets (...)."""
    terms = [
        decay**k * masked_mean(cross_entropy(logits, targets), mask)
        for k, (logits, targets, mask) in enumerate(zip(head_logits, head_targets, head_masks, strict=True))
    ]
    return torch.stack(terms).sum()


def eagle_loss(
    predicted_features: torch.Tensor,
    target_features: torch.Tensor,
    predicted_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    probability_weight: float = EAGLE_PROBABILITY_WEIGHT,
) -> torch.Tensor:
    """EAGLE-1: SmoothL1(f_hat, f) + probability_weight * CE(softmax(lm_head(f)), lm_head(f_hat)).

    Args:
        predicted_features, target_features: (..., h) f_hat_{i+1} and the base feature f_{i+1}.
        predicted_logits, target_logits: (..., V) lm_head of each (the target side without grad).
        mask: (...) supervised positions.
    """
    regression = F.smooth_l1_loss(predicted_features.float(), target_features.float(), reduction="none").mean(
        -1
    )
    target_probs = F.softmax(target_logits.float(), dim=-1)  # (..., V)
    classification = soft_cross_entropy(target_probs, predicted_logits)
    return masked_mean(regression, mask) + probability_weight * masked_mean(classification, mask)


def eagle3_targets(
    draft_logits: torch.Tensor, target_ids: torch.Tensor, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The base model's distribution restricted to the draft vocabulary, and where it is usable.

    Args:
        draft_logits: (..., N) the base's logits at the draft-vocabulary ids (``logits[..., t2d]``);
        target_ids: (...) the base's argmax over its whole vocabulary; t2d: (V,) bool, the draft vocabulary.
    Returns:
        ``(target_probs, in_draft_vocab)``: (..., N) softmax over the draft-vocabulary logits
        (renormalised, as the EAGLE-3 reference does), and (...) bool: the base argmax is a draft
        token (elsewhere the drafter cannot match the base model, so the loss skips the position).
    """
    return F.softmax(draft_logits.float(), dim=-1), t2d[target_ids]


def acceptance_rate(target_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position alpha = sum_v min(p_v, q_v) = 1 - TV(p, q): the chance that speculative sampling
    accepts a token drawn from q = softmax(logits) against the target p (Leviathan et al. 2023,
    "Fast Inference from Transformers via Speculative Decoding", sec. 3.3); (..., N) each -> (...)."""
    return torch.minimum(target_probs.float(), F.softmax(logits.float(), dim=-1)).sum(-1)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of a distribution (..., N) -> (...), 0 log 0 = 0."""
    probs = probs.float()
    return -(probs * probs.clamp(min=torch.finfo(probs.dtype).tiny).log()).sum(-1)


def log_acceptance_loss(target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of -log alpha: maximises the acceptance rate itself (its gradient is
    grad(alpha) / alpha, largest where the draft is accepted least). A position the draft cannot
    be accepted at (alpha = 0, no gradient through min) adds 0."""
    alpha = acceptance_rate(target_probs, logits)
    return masked_mean(torch.where(alpha > 0, -alpha.clamp(min=1e-30).log(), 0.0), mask)


def kl_acceptance_loss(
    target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor, decay: float = 1.0
) -> torch.Tensor:
    """w KL(p || q) + (1 - w)(1 - alpha_bar), w = exp(-decay alpha_bar), alpha_bar the batch's mean
    acceptance (held constant): distillation while the draft is poor, the acceptance rate as it
    improves (Samarin et al. 2026, "LK losses", arXiv 2602.23881; its default decay is 1)."""
    kl = soft_cross_entropy(target_probs, logits) - entropy(target_probs)
    alpha_bar = masked_mean(acceptance_rate(target_probs, logits), mask)
    weight = torch.exp(-decay * alpha_bar.detach())
    return weight * masked_mean(kl, mask) + (1 - weight) * (1 - alpha_bar)


def soft_and_hard_loss(
    target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor, hard_target_weight: float = 0.0
) -> torch.Tensor:
    """Masked mean of (1 - w) softCE + w CE(argmax p), w = ``hard_target_weight``."""
    w = hard_target_weight
    soft = soft_cross_entropy(target_probs, logits) if w < 1 else 0.0
    hard = cross_entropy(logits, target_probs.argmax(-1)) if w > 0 else 0.0
    return masked_mean((1 - w) * soft + w * hard, mask)


def top_k_cross_entropy(
    target_probs: torch.Tensor, log_probs: torch.Tensor, k: int = HASS_TOP_K
) -> torch.Tensor:
    """Per-position -sum_{v in top-k(p)} p_v log q_v: the soft CE's terms on the k tokens the base
    ranks highest, the only ones a tree of width <= k can draft; (..., N) probabilities and draft
    log-probabilities -> (...)."""
    k = min(k, target_probs.shape[-1])
    top = target_probs.float().topk(k, dim=-1)  # values, indices: (..., k)
    return -(top.values * log_probs.gather(-1, top.indices)).sum(-1)


def hass_loss(
    target_probs: torch.Tensor,
    logits: torch.Tensor,
    mask: torch.Tensor,
    top_k: int = HASS_TOP_K,
    top_k_weight: float = HASS_TOP_K_WEIGHT,
) -> torch.Tensor:
    """Masked mean of softCE + w top-k CE (HASS's harmonised objective distillation): the soft
    cross-entropy, with the terms of the base's top-k tokens counted 1 + w times, so the draft's
    probability mass goes first where a draft tree looks."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (..., N), once for both terms
    soft = -(target_probs.float() * log_probs).sum(-1)
    return masked_mean(soft + top_k_weight * top_k_cross_entropy(target_probs, log_probs, top_k), mask)


# EAGLE-3's head.objective: the loss of one training-time-test step, (target probs, logits, mask)
# -> a scalar. soft_ce is the EAGLE-3 reference's; only it takes head.hard_target_weight.
EAGLE3_STEP_LOSSES = {
    "soft_ce": soft_and_hard_loss,
    "log_acceptance": log_acceptance_loss,
    "kl_acceptance": kl_acceptance_loss,
    "hass": hass_loss,
}


def eagle3_loss(
    step_logits: Sequence[torch.Tensor],
    step_target_probs: Sequence[torch.Tensor],
    step_masks: Sequence[torch.Tensor],
    decay: float = EAGLE3_DECAY,
    hard_target_weight: float = 0.0,
    objective: str = "soft_ce",
) -> torch.Tensor:
    """sum_j decay^j * L_j over training-time-test steps; step j: (..., N) draft logits, (..., N)
    target probabilities (``eagle3_targets``; their argmax is the base model's where the mask
    holds), (...) mask (supervised and in the draft vocab). L_j is ``EAGLE3_STEP_LOSSES[objective]``;
    soft_ce's is (1 - w) softCE_j + w CE_j(argmax) with w = ``hard_target_weight``."""
    if objective not in EAGLE3_STEP_LOSSES:
        raise ValueError(f"objective must be one of {tuple(EAGLE3_STEP_LOSSES)}, got {objective!r}")
    if hard_target_weight and objective != "soft_ce":
        raise ValueError(f"hard_target_weight applies to the soft_ce objective, not {objective!r}")
    step_loss = EAGLE3_STEP_LOSSES[objective]
    if hard_target_weight:
        step_loss = functools.partial(step_loss, hard_target_weight=hard_target_weight)

    terms = [
        decay**j * step_loss(target_probs, logits, mask)
        for j, (logits, target_probs, mask) in enumerate(
            zip(step_logits, step_target_probs, step_masks, strict=True)
        )
    ]
    return torch.stack(terms).sum()


def mtp_loss(
    module_logits: Sequence[torch.Tensor],
    module_targets: Sequence[torch.Tensor],
    module_masks: Sequence[torch.Tensor],
    weight: float,
) -> torch.Tensor:
    """DeepSeek-V3's (lambda / D) sum_k CE_k with lambda = ``weight``; module k: (..., V) logits for
    the token k + 1 ahead, (...) targets, (...) mask."""
    terms = [
        masked_mean(cross_entropy(logits, targets), mask)
        for logits, targets, mask in zip(module_logits, module_targets, module_masks, strict=True)
    ]
    return weight * torch.stack(terms).mean()
