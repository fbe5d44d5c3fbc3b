"""Training losses of the draft heads, as pure functions.

Each takes predictions and targets that are already aligned (``draftheads.train.objective`` does
the shifting: which position predicts which token) with any leading shape ``...``, and a mask of
that leading shape (1 = a supervised position, i.e. an assistant token).
A masked mean divides by the number of supervised positions, so padding and prompt tokens never
dilute a loss; a step with no supervised position contributes 0 (and still carries a gradient
path, so every rank can call backward). Logits are upcast to float32 before any softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

MEDUSA_DECAY = 0.8  # w_k = 0.8^k for head k (Medusa paper, Medusa-1 training)
EAGLE_PROBABILITY_WEIGHT = 0.1  # weight of the soft CE next to the feature regression (EAGLE paper)
EAGLE3_DECAY = 0.8  # w_j = 0.8^j for training-time-test step j (EAGLE-3 training code)


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


def eagle3_loss(
    step_logits: Sequence[torch.Tensor],
    step_target_probs: Sequence[torch.Tensor],
    step_masks: Sequence[torch.Tensor],
    decay: float = EAGLE3_DECAY,
    hard_target_weight: float = 0.0,
) -> torch.Tensor:
    """sum_j decay^j * L_j over training-time-test steps, L_j = (1 - w) softCE_j + w CE_j(argmax)
    with w = ``hard_target_weight``; step j: (..., N) draft logits, (..., N) target probabilities
    (``eagle3_targets``; their argmax is the base model's where the mask holds), (...) mask
    (supervised and in the draft vocab)."""

    def step_loss(logits, target_probs):
        soft = soft_cross_entropy(target_probs, logits) if hard_target_weight < 1 else 0.0
        hard = cross_entropy(logits, target_probs.argmax(-1)) if hard_target_weight > 0 else 0.0
        return (1 - hard_target_weight) * soft + hard_target_weight * hard

    terms = [
        decay**j * masked_mean(step_loss(logits, target_probs), mask)
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
