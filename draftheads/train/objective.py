"""The training objective of each head kind: base hidden states in, loss and accuracy out.

The training recipes (``draftheads.train.recipe``) call ``compute_objective(head, hidden_states,
input_ids, loss_mask, attention_mask)`` on a batch's base hidden states (``output_hidden_states``
of the frozen base, a feature cache, or Medusa-2's adapted base). Each kind's function aligns
predictions with targets and calls its loss in ``draftheads.train.losses``.

Sampling. ``keep`` (B, T) bool, or None for everything, is the random subset a training step scores
(``train.loss_token_fraction``, see ``compute_objective``; ``draftheads.train.supervision`` lays
out what each step scores, on the host in training). Every random draw of a training batch
(``keep``, EAGLE's feature noise, DFlash's anchors) is a counter-based function of the row's seed
(``seeds`` (B,): ``draws.row_seeds`` of the run seed, epoch and dataset row), the token position
and the channel (``draftheads.train.draws``), never a per-process stream or a draw shaped like the
padded batch: a row scores the same tokens whatever its rank, micro-batch slot or padding.

Alignment. Token q is supervised iff ``loss_mask[q] == 1`` (and it is not padding). Every draft
step s (Medusa head s, EAGLE-3 training-time-test step s, MTP module s + 1; EAGLE-1 has one step)
predicts token q from the row q - (s + 2) of its output: Medusa head k at t predicts t + k + 2;
an EAGLE drafter row i consumes (f_i, t_{i+1}) and predicts t_{i+2}, one more per TTT step; MTP
module k at i predicts t_{i+k+1}. Vocab projections run only at the scored rows (the projection is
the largest matmul of a draft head: docs/training.md, "Throughput").

Accuracy per step: Medusa and MTP against the ground-truth token; EAGLE-1 and EAGLE-3 against the
base model's argmax at the same place (what greedy verification accepts), counting positions
whose argmax is outside EAGLE-3's draft vocabulary as misses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftheads.heads.layers import padded_causal_mask, shift_left
from draftheads.train import draws
from draftheads.train.chunked_loss import chunked_sums, rows_per_chunk
from draftheads.train.losses import (
    PositionTerms,
    cross_entropy,
    eagle3_loss,
    eagle3_step_loss,
    eagle3_targets,
    eagle_loss,
    medusa_loss,
    mtp_loss,
)
from draftheads.train.supervision import (
    Supervision,
    batch_seeds,
    plan_supervision,
)

TOP_K = 5  # the second accuracy reported per step


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable
    top1_correct: (
        torch.Tensor
    )  # (S,) correct top-1 predictions per draft step, summed over supervised positions
    top5_correct: torch.Tensor  # (S,)
    counted: torch.Tensor  # (S,) supervised positions counted per step
    # Named scalar parts of ``loss`` that training logs too (Medusa-2: "base_loss").
    loss_parts: dict[str, torch.Tensor] = field(default_factory=dict)


def base_precision(like: torch.Tensor):
    """Where the frozen base computes targets (its lm_head on its own hidden states): in the
    weights' precision even inside ``train.autocast``, so the head learns the distribution that
    decoding verifies against."""
    return torch.autocast(like.device.type, enabled=False)


@torch.no_grad()
def prediction_hits(
    logits: torch.Tensor, targets: torch.Tensor, to_target: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 hits, top-``TOP_K`` hits) of (M, V) logits against (M,) target ids, as 0-dim counts;
    ``to_target`` maps predicted ids to target ids (EAGLE-3)."""
    best = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices  # (M, k)
    if to_target is not None:
        best = to_target(best)
    hits = best == targets[:, None]  # (M, k)
    return hits[:, 0].sum(), hits.any(-1).sum()


def cross_entropy_chunk(project: Callable, rows: torch.Tensor, targets: torch.Tensor):
    """A chunk of a cross-entropy step (``chunked_sums``): (CE summed over its rows, top-1 hits,
    top-k hits) of ``project(rows)`` (C, V) against (C,) ``targets``."""
    logits = project(rows)
    return (cross_entropy(logits, targets).sum(), *prediction_hits(logits, targets))


def mean_cross_entropy(
    project: Callable, rows: torch.Tensor, targets: torch.Tensor, width: int, accuracy: StepAccuracy
) -> torch.Tensor:
    """The mean CE of ``project(rows)`` against ``targets`` over (M, h) rows, a chunk at a time;
    the step's hits go into ``accuracy``."""
    total, top1, topk = chunked_sums(functools.partial(cross_entropy_chunk, project), (rows, targets), width)
    accuracy.add_counts(top1, topk, targets.numel())
    return total / max(targets.numel(), 1)


class StepAccuracy:
    """Accumulates (top-1, top-k, counted) per draft step."""

    def __init__(self):
        self.top1: list[torch.Tensor] = []
        self.topk: list[torch.Tensor] = []
        self.counted: list[int] = []

    def add(self, logits: torch.Tensor, targets: torch.Tensor, to_target: Callable | None = None) -> None:
        """(M, V) logits, (M,) target ids; ``to_target`` maps predicted ids to target ids (EAGLE-3)."""
        self.add_counts(*prediction_hits(logits, targets, to_target), targets.numel())

    def add_counts(self, top1: torch.Tensor, topk: torch.Tensor, counted: int) -> None:
        """A step's hit counts (``prediction_hits``, summed over chunks) out of ``counted`` targets."""
        self.top1.append(top1)
        self.topk.append(topk)
        self.counted.append(counted)

    def output(self, loss: torch.Tensor) -> ObjectiveOutput:
        device = loss.device
        return ObjectiveOutput(
            loss=loss,
            top1_correct=torch.stack(self.top1).float().to(device),
            top5_correct=torch.stack(self.topk).float().to(device),
            counted=torch.tensor(self.counted, dtype=torch.float32, device=device),
        )


def ones_like_rows(rows: torch.Tensor) -> torch.Tensor:
    """All-supervised mask for rows already gathered at supervised positions."""
    return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)


# ---- per kind ---------------------------------------------------------------------------------


def medusa_objective(
    head, hidden_states, input_ids, attention_mask, plan: Supervision, seeds=None, base_argmax=None
) -> ObjectiveOutput:
    features = head.select_features(hidden_states)  # (B, T, h)
    accuracy = StepAccuracy()
    head_losses = []
    for k, scored in enumerate(plan.steps):  # head k at row q - (k + 2) predicts t_q
        targets = input_ids[scored.batch, scored.position]  # (M,)
        project = functools.partial(head.head_logits, index=k)  # (C, h) -> (C, V)
        rows = features[scored.batch, scored.row]  # (M, h)
        head_losses.append(mean_cross_entropy(project, rows, targets, head.base_spec.vocab_size, accuracy))
    return accuracy.output(medusa_loss(head_losses))


def eagle_objective(
    head, hidden_states, input_ids, attention_mask, plan: Supervision, seeds=None, base_argmax=None
) -> ObjectiveOutput:
    features = head.select_features(hidden_states)  # (B, T, h) = hs[L]
    batch_size, length = input_ids.shape
    inputs = features
    if head.training and head.config.feature_noise > 0:
        noise = head.config.feature_noise
        uniform = draws.uniform(seeds, draws.FEATURE_NOISE, length, features.shape[-1], features.device)
        inputs = features + ((uniform * 2 - 1) * noise).to(features.dtype)  # (B, T, h) U(-noise, noise)
    mask = padded_causal_mask(
        attention_mask, batch_size, length, features.dtype, features.device
    )  # (B, 1, T, T)
    positions = torch.arange(length, device=features.device)[None].expand(batch_size, length)  # (B, T)
    # Row i: (f_i, t_{i+1}) -> f_hat_{i+1}; the last row has no next token and is never supervised.
    predicted = head.predict_features(inputs, shift_left(input_ids, 1), positions, mask)  # (B, T, h)

    (scored,) = plan.steps  # row q - 2 predicts t_q through f_hat_{q-1}
    predicted_rows = predicted[scored.batch, scored.row]  # (M, h)
    target_rows = features[scored.batch, scored.position - 1]  # (M, h) the clean f_{q-1}
    predicted_logits = head.base_lm_head(predicted_rows)  # (M, V)
    with torch.no_grad(), base_precision(target_rows):
        target_logits = head.base_lm_head(target_rows)  # (M, V)
    loss = eagle_loss(
        predicted_rows, target_rows, predicted_logits, target_logits, ones_like_rows(scored.row)
    )
    accuracy = StepAccuracy()
    accuracy.add(predicted_logits, target_logits.argmax(-1))
    return accuracy.output(loss)


def draft_vocab_logits(head, rows: torch.Tensor) -> torch.Tensor:
    """(M, h) -> (M, N) the base lm_head's logits at EAGLE-3's draft-vocabulary ids only (ascending
    target id, i.e. draft id order): ``base_lm_head(rows)[:, t2d]`` at N/V of its cost."""
    lm_head = head.base_lm_head
    ids = head.draft_target_ids()
    bias = None if lm_head.bias is None else lm_head.bias[ids]
    return torch.nn.functional.linear(rows, lm_head.weight[ids], bias)


def eagle3_objective(
    head, hidden_states, input_ids, attention_mask, plan: Supervision, seeds=None, base_argmax=None
) -> ObjectiveOutput:
    features = head.select_features(hidden_states)  # (B, T, 3h)
    last_hidden = hidden_states[head.base_spec.num_hidden_layers]  # (B, T, h), what enters lm_head
    unrolled = head.training_time_test(features, input_ids, attention_mask, plan.chains)  # S x (B, R_j, h)
    needed_batch, needed_position = plan.targets  # the distinct tokens q scored, (M,) each
    with torch.no_grad(), base_precision(last_hidden):
        rows_before = last_hidden[needed_batch, needed_position - 1]  # (M, h): the base's at q - 1
        known = None if base_argmax is None else base_argmax[needed_batch, needed_position - 1]
        table = eagle3_target_table(head, rows_before, known)

    step_loss = eagle3_step_loss(head.config.objective, head.config.hard_target_weight)
    score = functools.partial(eagle3_chunk, head, step_loss, table)
    accuracy = StepAccuracy()
    step_losses = []
    for state, scored in zip(unrolled.states, plan.steps):
        at = scored.table_row  # (M_j,) rows of the target table
        sums, top1, topk = chunked_sums(score, (state[scored.batch, scored.row], at), head.draft_vocab_size)
        accuracy.add_counts(top1, topk, at.numel())
        count = table.in_draft_vocab[at].sum().clamp(min=1).to(sums.dtype)
        step_losses.append(step_loss.combine(sums, count))
    return accuracy.output(eagle3_loss(step_losses))


@dataclass(frozen=True)
class Eagle3Targets:
    """The base's side of EAGLE-3's loss, one row per distinct scored token (no gradient).

    target_ids: (M,) the base's argmax over its whole vocabulary; draft_logits: (M, N) its logits
    at the draft-vocabulary ids, in the base's dtype (softmaxed in fp32 a chunk at a time, so no
    (M, N) fp32 copy is held); in_draft_vocab: (M,) the argmax is a draft token (elsewhere the
    drafter cannot match the base, so the loss skips the row).
    """

    target_ids: torch.Tensor
    draft_logits: torch.Tensor
    in_draft_vocab: torch.Tensor


def eagle3_target_table(head, rows_before: torch.Tensor, base_argmax: torch.Tensor | None) -> Eagle3Targets:
    """The targets of (M, h) base states entering lm_head. With the argmax known (a feature cache
    stores it), only the draft vocabulary's rows of lm_head run; without it, the full-vocabulary
    projection runs a chunk of rows at a time, for its argmax."""
    if base_argmax is not None:
        target_ids, draft_logits = base_argmax, draft_vocab_logits(head, rows_before)
    else:
        ids, logits, draft_ids = [], [], head.draft_target_ids()
        for part in rows_before.split(rows_per_chunk(head.base_spec.vocab_size)) or (rows_before,):
            full = head.base_lm_head(part)  # (C, V)
            ids.append(full.argmax(-1))
            logits.append(full[:, draft_ids])
        target_ids, draft_logits = torch.cat(ids), torch.cat(logits)
    return Eagle3Targets(target_ids, draft_logits, head.t2d[target_ids])


def eagle3_chunk(head, step_loss: PositionTerms, table: Eagle3Targets, rows: torch.Tensor, at: torch.Tensor):
    """A chunk of one TTT step (``chunked_sums``): ``step_loss``'s masked term sums over (C, h)
    drafter states whose targets are ``table``'s rows ``at`` (C,), and its top-1 / top-k hits."""
    logits = head.logits(rows)  # (C, N)
    target_probs, _ = eagle3_targets(table.draft_logits[at], table.target_ids[at], head.t2d)  # (C, N)
    sums = step_loss.masked_sums(target_probs, logits, table.in_draft_vocab[at])  # (K,)
    return (sums, *prediction_hits(logits, table.target_ids[at], head.draft_to_target))


def mtp_objective(
    head, hidden_states, input_ids, attention_mask, plan: Supervision, seeds=None, base_argmax=None
) -> ObjectiveOutput:
    features = head.select_features(hidden_states)  # (B, T, h) = hs[L] = h^0
    states = head.unroll(features, input_ids, attention_mask)  # D x (B, T, h)
    accuracy = StepAccuracy()
    module_losses = []
    for index, (state, scored) in enumerate(zip(states, plan.steps)):  # module index + 1 at q - (index + 2)
        targets = input_ids[scored.batch, scored.position]  # (M,)
        project = functools.partial(head.module_logits, index)  # (C, h) -> (C, V)
        rows = state[scored.batch, scored.row]  # (M, h)
        module_losses.append(mean_cross_entropy(project, rows, targets, head.base_spec.vocab_size, accuracy))
    return accuracy.output(mtp_loss(module_losses, weight=head.config.loss_weight))


OBJECTIVES: dict[str, Callable[..., ObjectiveOutput]] = {
    "medusa": medusa_objective,
    "eagle": eagle_objective,
    "eagle3": eagle3_objective,
    "peagle": eagle3_objective,  # EAGLE-3's training-time test with mask rows (heads.peagle)
    "mtp": mtp_objective,
}


def compute_objective(
    head,
    hidden_states,
    input_ids,
    loss_mask,
    attention_mask,
    token_fraction: float = 1.0,
    sample_seed: int | torch.Tensor | None = None,
    base_argmax: torch.Tensor | None = None,
    supervision: Supervision | None = None,
) -> ObjectiveOutput:
    """Loss and per-step accuracy of ``head`` on one batch.

    Args:
        head: a DraftHead attached to the frozen base model.
        hidden_states: the base model's ``output_hidden_states`` tuple, or a dict index -> (B, T, h)
            holding at least ``head.required_hidden_states``.
        input_ids: (B, T); loss_mask: (B, T), 1 where the token is supervised; attention_mask:
            (B, T), 0 on padding (or None).
        token_fraction: in training mode, score only a random fraction of the supervised tokens
            (``sample_keep``): Medusa, EAGLE and MTP keep each token q with this probability;
            EAGLE-3 keeps each drafter row's whole chain (all its TTT steps, or, with the head's
            ``cod_ratio`` below 1, the steps COD sampling draws for it), so the unrolled steps
            after the first run on that fraction of rows. Evaluation scores everything.
        sample_seed: (B,) int64, the seed of each row's random draws (the training loop passes
            ``draws.row_seeds`` of its seed, the epoch and the rows' dataset indices, so a row
            draws the same numbers wherever it is batched); one int seeds the rows by slot; None
            draws the seeds from torch's global RNG (``batch_seeds``).
        base_argmax: (B, T) the base model's next-token argmax at each position, where it is known
            without lm_head (a feature cache stores it): EAGLE-3 then projects only the draft
            vocabulary's rows of lm_head, and DFlash's base targets need no projection. None:
            computed here.
        supervision: what the batch's steps score, laid out on the host from the same masks,
            seeds and ``token_fraction`` (``draftheads.train.supervision``); None: laid out here.
    """
    if head.kind not in OBJECTIVES:
        raise ValueError(
            f"no training objective for head kind '{head.kind}'; known kinds: {', '.join(sorted(OBJECTIVES))}"
        )
    seeds = batch_seeds(sample_seed, input_ids.shape[0]) if head.training else None
    if supervision is None:
        supervision = plan_supervision(head, loss_mask, attention_mask, token_fraction, seeds)
    objective = OBJECTIVES[head.kind]
    return objective(head, hidden_states, input_ids, attention_mask, supervision, seeds, base_argmax)


# ---- DFlash -----------------------------------------------------------------------------------


def dflash_objective(
    head, hidden_states, input_ids, attention_mask, plan: Supervision, seeds=None, base_argmax=None
) -> ObjectiveOutput:
    """DFlash (arXiv 2602.06036, sec. 4): blocks anchored at positions a whose next token is
    supervised (up to ``anchors_per_sequence`` per sequence: at random in training, by the rows'
    ``seeds``; evenly spaced in evaluation; ``keep`` samples anchors), all in one forward; block
    row k (1..K-1) predicts t_{a+k} with cross-entropy against the data's token, weighted
    exp(-(k - 1) / loss_decay) and normalised by the total weight of the rows scored. Step k - 1's
    accuracy is block row k's top-1 against the same target. ``head.config.targets == "base"``
    replaces the data's token by the base model's argmax at the position before it."""
    from draftheads.heads.dflash import block_position_weights

    features = head.select_features(hidden_states)  # (B, T, F h)
    anchors, valid = plan.anchors  # (B, N) each
    states = head.training_blocks(features, input_ids, attention_mask, anchors, valid)  # (B, N, K, h)
    decay = head.config.loss_decay
    weights = block_position_weights(head.block_size, decay)  # K - 1 floats
    targets_at = input_ids  # (B, T): what block row k at anchor a is scored against, at a + k
    if plan.targets is not None:  # the base's greedy token, once per position any block scores
        batch, position = plan.targets
        last_hidden = hidden_states[head.base_spec.num_hidden_layers]  # (B, T, h), enters lm_head
        targets_at = input_ids.clone()
        if base_argmax is not None:  # a feature cache stored it
            targets_at[batch, position] = base_argmax[batch, position - 1]
        else:
            with torch.no_grad(), base_precision(last_hidden):
                targets_at[batch, position] = head.base_lm_head(last_hidden[batch, position - 1]).argmax(-1)

    accuracy = StepAccuracy()
    weighted_sum = states.new_zeros((), dtype=torch.float32)
    total_weight = 0.0
    for row, scored in enumerate(plan.steps, start=1):
        targets = targets_at[scored.batch, scored.position]  # (M,)
        score = functools.partial(cross_entropy_chunk, head.logits)
        losses, top1, topk = chunked_sums(
            score, (states[scored.batch, scored.row, row], targets), head.base_spec.vocab_size
        )
        accuracy.add_counts(top1, topk, targets.numel())
        weighted_sum = weighted_sum + weights[row - 1] * losses
        total_weight += weights[row - 1] * targets.numel()
    return accuracy.output(weighted_sum / max(total_weight, 1e-6))


OBJECTIVES["dflash"] = dflash_objective
