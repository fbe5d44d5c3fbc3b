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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def medusa_loss(head_losses: Sequence[torch.Tensor], decay: float = MEDUSA_DECAY) -> torch.Tensor:
    """sum_k decay^k * CE_k (Medusa-1), CE_k head k's mean cross-entropy on the token k + 2 ahead."""
    return torch.stack([decay**k * loss for k, loss in enumerate(head_losses)]).sum()


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


@dataclass(frozen=True)
class PositionTerms:
    """A loss that is a function of masked sums of per-position terms, so rows can be scored a
    chunk at a time and the chunks' sums added (``draftheads.train.chunked_loss``).

    terms: (target probs (..., N), logits (..., N)) -> (..., K) per-position terms;
    combine: (their masked sums (K,), the supervised count, at least 1) -> the scalar loss.
    """

    terms: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def masked_sums(
        self, target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """(K,) sums of ``terms`` over the positions ``mask`` (...) keeps."""
        terms = self.terms(target_probs, logits)  # (..., K)
        return (terms * mask[..., None].to(terms.dtype)).reshape(-1, terms.shape[-1]).sum(0)

    def __call__(self, target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The loss over all positions at once: ``terms``' masked sums, combined."""
        sums = self.masked_sums(target_probs, logits, mask)  # (K,)
        return self.combine(sums, mask.sum().clamp(min=1).to(sums.dtype))


def mean_of_sums(sums: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The masked mean of a single per-position term."""
    return sums[0] / count


def log_acceptance_terms(target_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """-log alpha per position (..., 1); a position the draft cannot be accepted at (alpha = 0, no
    gradient through min) adds 0."""
    alpha = acceptance_rate(target_probs, logits)
    return torch.where(alpha > 0, -alpha.clamp(min=1e-30).log(), 0.0)[..., None]


# -log alpha: maximises the acceptance rate itself (its gradient is grad(alpha) / alpha, largest
# where the draft is accepted least).
log_acceptance_loss = PositionTerms(log_acceptance_terms, mean_of_sums)


def kl_and_alpha_terms(target_probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(KL(p || q), alpha) per position, (..., 2)."""
    kl = soft_cross_entropy(target_probs, logits) - entropy(target_probs)
    return torch.stack([kl, acceptance_rate(target_probs, logits)], dim=-1)


def kl_acceptance_of_sums(sums: torch.Tensor, count: torch.Tensor, decay: float = 1.0) -> torch.Tensor:
    """w KL(p || q) + (1 - w)(1 - alpha_bar), w = exp(-decay alpha_bar), alpha_bar the batch's mean
    acceptance (held constant): distillation while the draft is poor, the acceptance rate as it
    improves (Samarin et al. 2026, "LK losses", arXiv 2602.23881; its default decay is 1)."""
    alpha_bar = sums[1] / count
    weight = torch.exp(-decay * alpha_bar.detach())
    return weight * sums[0] / count + (1 - weight) * (1 - alpha_bar)


kl_acceptance_loss = PositionTerms(kl_and_alpha_terms, kl_acceptance_of_sums)


def soft_and_hard_terms(
    target_probs: torch.Tensor, logits: torch.Tensor, hard_target_weight: float = 0.0
) -> torch.Tensor:
    """(1 - w) softCE + w CE(argmax p) per position, (..., 1), w = ``hard_target_weight``."""
    w = hard_target_weight
    soft = soft_cross_entropy(target_probs, logits) if w < 1 else 0.0
    hard = cross_entropy(logits, target_probs.argmax(-1)) if w > 0 else 0.0
    return ((1 - w) * soft + w * hard)[..., None]


def soft_and_hard_loss(hard_target_weight: float = 0.0) -> PositionTerms:
    """The masked mean of ``soft_and_hard_terms``."""
    terms = functools.partial(soft_and_hard_terms, hard_target_weight=hard_target_weight)
    return PositionTerms(terms, mean_of_sums)


def top_k_cross_entropy(
    target_probs: torch.Tensor, log_probs: torch.Tensor, k: int = HASS_TOP_K
) -> torch.Tensor:
    """Per-position -sum_{v in top-k(p)} p_v log q_v: the soft CE's terms on the k tokens the base
    ranks highest, the only ones a tree of width <= k can draft; (..., N) probabilities and draft
    log-probabilities -> (...)."""
    k = min(k, target_probs.shape[-1])
    top = target_probs.float().topk(k, dim=-1)  # values, indices: (..., k)
    return -(top.values * log_probs.gather(-1, top.indices)).sum(-1)


def hass_terms(
    target_probs: torch.Tensor,
    logits: torch.Tensor,
    top_k: int = HASS_TOP_K,
    top_k_weight: float = HASS_TOP_K_WEIGHT,
) -> torch.Tensor:
    """softCE + w top-k CE per position, (..., 1) (HASS's harmonised objective distillation): the
    soft cross-entropy, with the terms of the base's top-k tokens counted 1 + w times, so the
    draft's probability mass goes first where a draft tree looks."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (..., N), once for both terms
    soft = -(target_probs.float() * log_probs).sum(-1)
    return (soft + top_k_weight * top_k_cross_entropy(target_probs, log_probs, top_k))[..., None]


def hass_loss(top_k: int = HASS_TOP_K, top_k_weight: float = HASS_TOP_K_WEIGHT) -> PositionTerms:
    """The masked mean of ``hass_terms``."""
    return PositionTerms(functools.partial(hass_terms, top_k=top_k, top_k_weight=top_k_weight), mean_of_sums)


# EAGLE-3's head.objective: the loss of one training-time-test step as ``PositionTerms``, callable
# as (target probs, logits, mask) -> a scalar. soft_ce is the EAGLE-3 reference's; only it takes
# head.hard_target_weight (``eagle3_step_loss``).
EAGLE3_STEP_LOSSES = {
    "soft_ce": soft_and_hard_loss(),
    "log_acceptance": log_acceptance_loss,
    "kl_acceptance": kl_acceptance_loss,
    "hass": hass_loss(),
}


def eagle3_step_loss(objective: str = "soft_ce", hard_target_weight: float = 0.0) -> PositionTerms:
    """The loss of one training-time-test step under ``objective``, checked."""
    if objective not in EAGLE3_STEP_LOSSES:
        raise ValueError(f"objective must be one of {tuple(EAGLE3_STEP_LOSSES)}, got {objective!r}")
    if hard_target_weight and objective != "soft_ce":
        raise ValueError(f"hard_target_weight applies to the soft_ce objective, not {objective!r}")
    if hard_target_weight:
        return soft_and_hard_loss(hard_target_weight)
    return EAGLE3_STEP_LOSSES[objective]


def eagle3_loss(step_losses: Sequence[torch.Tensor], decay: float = EAGLE3_DECAY) -> torch.Tensor:
    """sum_j decay^j * L_j over training-time-test steps, L_j step j's ``eagle3_step_loss`` over its
    scored rows (supervised, and the base's argmax in the draft vocabulary)."""
    return torch.stack([decay**j * loss for j, loss in enumerate(step_losses)]).sum()


def mtp_loss(module_losses: Sequence[torch.Tensor], weight: float) -> torch.Tensor:
    """DeepSeek-V3's (lambda / D) sum_k CE_k with lambda = ``weight``, CE_k module k's mean
    cross-entropy on the token k + 1 ahead."""
    return weight * torch.stack(list(module_losses)).mean()
