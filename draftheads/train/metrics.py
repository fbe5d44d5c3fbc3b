"""Held-out evaluation (per-step top-1/top-5, chain acceptance), the record of the decode
evaluation next to it (``draftheads.train.decode_eval``), and throughput measurement.

The frozen base model's body produces the hidden states every head trains on; its lm_head is
not run (heads call it themselves where their objective needs it, at the supervised rows only), so
online training does not pay for a full-vocabulary projection at every position (the vocabulary
projections are a step's largest matmuls: docs/training.md, "Throughput").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from draftheads.timing import synchronize


@torch.no_grad()
def base_hidden_states(
    base_model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    layers: Sequence[int] | None = None,
) -> tuple:
    """HF ``hidden_states`` tuple (L + 1 entries of (B, T, h)) of the frozen base model's body.

    ``layers``: the indices to keep (a head's ``required_hidden_states``); the others are None, so
    a forward holds 3 or 4 of an 8B base's 33 states, not all of them. None keeps every one."""
    outputs = base_model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True if layers is None else list(layers),
        use_cache=False,
    )
    return outputs.hidden_states


def chain_acceptance(accuracies: Sequence[float]) -> float:
    """Expected tokens per base forward if draft step k is accepted with probability acc_k
    independently and a chain stops at the first rejection: 1 + sum_k prod_{j<=k} acc_j.
    (The leading 1 is the token the base model produces itself at every step.)"""
    total, running = 1.0, 1.0
    for accuracy in accuracies:
        running *= accuracy
        total += running
    return total


def _decimals(values: Sequence[float]) -> str:
    return " ".join(f"{value:.3f}" for value in values)


@dataclass(frozen=True)
class DecodeEvalResult:
    """Acceptance as decoding sees it (``draftheads.train.decode_eval``); tuples have one entry
    per draft depth: ``top1[d]`` = P(the drafter's first choice at depth d + 1 is the base model's
    greedy token | every depth above it was), on the base's greedy continuations of held-out
    prompts; ``counted[d]``: the positions behind it."""

    top1: tuple[float, ...]
    counted: tuple[int, ...]
    chain_acceptance: float  # 1 + sum_d prod_{j<=d} top1_j: tokens per step of a greedy chain
    prompts: int

    @classmethod
    def from_acceptance(cls, acceptance, prompts: int) -> DecodeEvalResult:
        """From a ``draftheads.tuning.acceptance.AcceptanceModel``: its rank-0 column."""
        top1 = tuple(row[0] for row in acceptance.probabilities)
        return cls(top1, tuple(acceptance.counts), chain_acceptance(top1), prompts)

    def summary(self) -> str:
        return (
            f"decode on {self.prompts} prompts: top-1 {_decimals(self.top1)} "
            f"chain acceptance {self.chain_acceptance:.3f}"
        )


@dataclass(frozen=True)
class EvalResult:
    """Held-out metrics; tuples have one entry per draft step (Medusa head / TTT step / module)."""

    loss: float
    top1: tuple[float, ...]
    top5: tuple[float, ...]
    counted: tuple[int, ...]
    chain_acceptance: float
    decode: DecodeEvalResult | None = None  # with train.decode_eval_prompts > 0

    def to_dict(self) -> dict:
        """Plain data; no ``decode`` key when there is no decode evaluation."""
        record = asdict(self)
        if self.decode is None:
            del record["decode"]
        return record

    @classmethod
    def from_dict(cls, record: dict) -> EvalResult:
        decode = record.get("decode")
        return cls(**{**record, "decode": DecodeEvalResult(**decode) if decode else None})

    def summary(self) -> str:
        """One line: ``loss 2.1043 top-1 0.485 0.402 chain acceptance 1.680`` and the decode part."""
        chain = f"chain acceptance {self.chain_acceptance:.3f}"
        line = f"loss {self.loss:.4f} top-1 {_decimals(self.top1)} {chain}"
        return line if self.decode is None else f"{line}; {self.decode.summary()}"


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    from torch import distributed

    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        distributed.all_reduce(tensor)
    return tensor


@torch.no_grad()
def evaluate(objective: Callable[[dict], Any], batches: Sequence[dict], device: torch.device) -> EvalResult:
    """Run ``objective(batch) -> ObjectiveOutput`` (a training recipe on the validation split,
    ``draftheads.train.recipe``) over ``batches`` and aggregate accuracies over every supervised
    position.

    The caller puts the head in eval mode. Under data parallelism each rank passes its share of
    the batches; counts are summed over ranks, so every rank returns the same result.
    """
    top1 = top5 = counted = None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for batch in batches:
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        output = objective(batch)
        if top1 is None:
            top1 = torch.zeros_like(output.top1_correct, dtype=torch.float64)  # (S,)
            top5 = torch.zeros_like(top1)
            counted = torch.zeros_like(top1)
        top1 += output.top1_correct.double()
        top5 += output.top5_correct.double()
        counted += output.counted.double()
        loss_sum += output.loss.double()
    if top1 is None:
        raise ValueError("evaluate: no evaluation batches (is the validation split empty?)")
    stats = _all_reduce_sum(
        torch.cat([top1, top5, counted, loss_sum.new_tensor([len(batches)]), loss_sum[None]])
    )
    steps = top1.numel()
    top1, top5, counted = stats[:steps], stats[steps : 2 * steps], stats[2 * steps : 3 * steps]
    batch_count, loss_total = stats[3 * steps], stats[3 * steps + 1]
    top1_accuracy = (top1 / counted.clamp(min=1)).tolist()
    return EvalResult(
        loss=float(loss_total / batch_count.clamp(min=1)),
        top1=tuple(top1_accuracy),
        top5=tuple((top5 / counted.clamp(min=1)).tolist()),
        counted=tuple(int(c) for c in counted.tolist()),
        chain_acceptance=chain_acceptance(top1_accuracy),
    )


@torch.no_grad()
def base_forward_tokens_per_second(base_model, batches: Sequence[dict], device: torch.device) -> float:
    """Tokens/s of the frozen base body alone (forward, no grad) over ``batches``: the ceiling
    online training is measured against (docs/training.md, "Throughput"). Counts non-pad tokens, like the
    training loop's tokens/s; the first batch is a warm-up and is not timed."""
    if not batches:
        raise ValueError("base_forward_tokens_per_second: no batches")
    batches = [{name: tensor.to(device) for name, tensor in batch.items()} for batch in batches]
    base_hidden_states(base_model, batches[0]["input_ids"], batches[0]["attention_mask"])
    timed = batches[1:] or batches
    tokens = 0
    synchronize(device)  # the warm-up's queued work is not timed
    start = time.perf_counter()
    for batch in timed:
        base_hidden_states(base_model, batch["input_ids"], batch["attention_mask"])
        tokens += int(batch["attention_mask"].sum())
    synchronize(device)
    return tokens / (time.perf_counter() - start)
