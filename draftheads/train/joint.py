"""Medusa-2: the heads and a LoRA adapter on the base train together (Cai et al. 2024, "Medusa",
sec. 2.2.2), as the training recipe ``JointRecipe`` (``draftheads.train.recipe``).

L = L_base + lambda0(step) * sum_k 0.8^k CE_k, where L_base is either
- ``lm``: next-token CE of the adapted base on assistant tokens (real data), or
- ``kl``: KL(p_original || p_adapted) on assistant tokens (self-distilled data, sec. 2.3.2), the
  teacher being the same model with its adapter disabled (peft ``disable_adapter()``: no second
  copy in memory).
The head loss reads the adapted base's hidden states and its gradient reaches the adapter too:
the base learns to be predictable by its heads while L_base keeps it close to itself.

The adapter is peft's LoRA (rank, alpha, dropout, target modules from ``JointConfig``); the heads
train at ``train.learning_rate``, the adapter at ``learning_rate / joint.head_lr_multiple``
(FasterDecoding/Medusa's ``medusa_lr_multiplier`` of 4).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn

from draftheads.config import JointConfig, RunConfig
from draftheads.heads.adapter import ADAPTER_DIR
from draftheads.settings import ConfigError
from draftheads.train.losses import cross_entropy, kl_divergence, masked_mean
from draftheads.train.objective import ObjectiveOutput, compute_objective, ones_like_rows
from draftheads.train.supervision import Supervision, offset_rows, supervised_mask, training_supervision


def head_loss_weight(step: int, total_steps: int, peak: float, warmup_ratio: float) -> float:
    """lambda0 at optimiser step ``step``: peak * sin(pi/2 * step / ramp) over the first
    ramp = warmup_ratio * total_steps steps, then peak (FasterDecoding/Medusa's "sine" medusa_scheduler)."""
    ramp = warmup_ratio * total_steps
    if ramp <= 0 or step >= ramp:
        return peak
    return peak * math.sin(step / ramp * math.pi / 2)


def add_lora_adapter(base_model, joint: JointConfig):
    """Wrap ``base_model`` in a peft LoRA adapter (in place: its linear layers gain LoRA branches,
    the base weights stay frozen). Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    target = joint.lora_target_modules
    config = LoraConfig(
        r=joint.lora_rank,
        lora_alpha=joint.lora_alpha,
        lora_dropout=joint.lora_dropout,
        target_modules=target if isinstance(target, str) else list(target),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(base_model, config)
    except ValueError as err:  # e.g. target modules that match nothing
        raise ConfigError(f"joint.lora_target_modules {target!r}: {err}") from err


def dropout_seed(sample_seed: int | torch.Tensor) -> int:
    """One int for torch's global RNG from a batch's ``sample_seed`` (an int, or its (B,) row
    seeds, hashed in order)."""
    if isinstance(sample_seed, torch.Tensor) and sample_seed.dim() == 1:
        key = ":".join(str(seed) for seed in sample_seed.tolist()).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1  # < 2^63
    return int(sample_seed)


def next_token_rows(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None) -> Supervision:
    """The base loss's rows: row q - 1 predicts each supervised token q (one step)."""
    return Supervision(offset_rows(supervised_mask(loss_mask, attention_mask), range(1, 2)))


class JointRecipe(nn.Module):
    """The LoRA-adapted base and the heads as one module, so one DeepSpeed engine trains both;
    ``forward`` runs the adapted base on the batch itself. ``head_loss_weight`` is lambda0 for the
    current optimiser step (``begin_step``)."""

    exclude_frozen = True  # the module holds the whole base, of which only the adapter trains

    def __init__(self, adapted_base, head: nn.Module, joint: JointConfig, token_fraction: float = 1.0):
        super().__init__()
        self.adapted_base = adapted_base  # PeftModel; only its LoRA weights require grad
        self.head = head
        self.joint = joint
        self.head_loss_weight = 0.0
        self.token_fraction = token_fraction  # of supervised tokens the heads score (not the base loss)

    @staticmethod
    def check(run: RunConfig) -> None:
        if run.data.features:
            raise ConfigError(
                f"data.features ({run.data.features}) cannot feed head.joint training: the adapted base's "
                "hidden states change every step; unset one of them"
            )
        if run.train.autocast != "none":
            raise ConfigError(
                f"train.autocast={run.train.autocast}: not supported for joint (Medusa-2) heads, whose "
                "base trains with them; use train.precision instead"
            )
        if run.train.init_head:
            raise ConfigError(
                f"train.init_head={run.train.init_head}: not supported for joint (Medusa-2) heads, whose "
                "adapter is part of the base"
            )

    @classmethod
    def build(cls, run, base_model, head, *, tokenizer, splits, dtype, log) -> JointRecipe:
        """Wrap ``base_model`` in the adapter (in place); the base computes its own hidden states,
        so tokenizer, splits, dtype and log go unused."""
        return cls(add_lora_adapter(base_model, run.joint), head, run.joint, run.train.loss_token_fraction)

    def _body(self, input_ids, layers: tuple[int, ...] | None):
        """The adapted base's body; ``hidden_states`` keeps ``layers`` only (None: none, the last
        normed state is ``last_hidden_state``). No padding mask: batches are right-padded, so a real
        token's states need none (``draftheads.train.hidden_states.OnlineHiddenStates``)."""
        causal_lm = self.adapted_base.get_base_model()  # the HF model, LoRA layers injected
        return causal_lm.base_model(
            input_ids=input_ids,
            output_hidden_states=False if layers is None else list(layers),
            use_cache=False,
        )

    def forward(self, batch: dict, split: str) -> ObjectiveOutput:
        sample_seed = batch.get("sample_seed")
        if not self.training or sample_seed is None:
            return self._forward(batch, sample_seed)
        # LoRA dropout draws (B, T, h) masks from torch's global RNG: seed it from the batch's row
        # seeds, so the adapter sees the same masks whatever rank runs the batch. Unlike the heads'
        # counter-based draws (draftheads.train.draws), these masks follow the whole micro-batch:
        # its rows, their order and its padded length.
        devices = [batch["input_ids"].device] if batch["input_ids"].is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(dropout_seed(sample_seed))
            return self._forward(batch, sample_seed)

    def _forward(self, batch: dict, sample_seed: int | torch.Tensor | None) -> ObjectiveOutput:
        input_ids, loss_mask, attention_mask = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        lm_head = self.adapted_base.get_base_model().get_output_embeddings()
        layers = tuple(self.head.required_hidden_states)  # the rest of the L + 1 entries are None
        hidden_states = self._body(input_ids, layers).hidden_states
        base_rows = batch.get("base_rows") or next_token_rows(loss_mask, attention_mask)
        (scored,) = base_rows.steps
        rows_batch, rows = scored.batch, scored.row  # row q - 1 predicts token q
        student_logits = lm_head(hidden_states[-1][rows_batch, rows])  # (M, V)
        if self.joint.base_loss == "lm":
            per_token = cross_entropy(student_logits, input_ids[rows_batch, rows + 1])  # (M,)
        else:
            with torch.no_grad(), self.adapted_base.disable_adapter():
                teacher_hidden = self._body(input_ids, None).last_hidden_state  # (B, T, h)
                teacher_logits = lm_head(teacher_hidden[rows_batch, rows])  # (M, V)
            per_token = kl_divergence(teacher_logits, student_logits)  # (M,)
        base_loss = masked_mean(per_token, ones_like_rows(per_token))
        heads = compute_objective(
            self.head,
            hidden_states,
            input_ids,
            loss_mask,
            attention_mask,
            self.token_fraction,
            sample_seed,
            supervision=batch.get("supervision"),
        )
        heads.loss = base_loss + self.head_loss_weight * heads.loss
        heads.loss_parts["base_loss"] = base_loss
        return heads

    def host_inputs(self, host_batch: dict) -> dict:
        supervision = training_supervision(self.head, host_batch, self.token_fraction)
        base_rows = next_token_rows(host_batch["loss_mask"], host_batch["attention_mask"])
        return {"supervision": supervision, "base_rows": base_rows}

    def parameter_groups(self, learning_rate: float) -> list[dict]:
        """The heads at ``learning_rate``, the adapter at ``learning_rate / joint.head_lr_multiple``."""
        head_parameters = [p for p in self.head.parameters() if p.requires_grad]
        adapter_parameters = [p for p in self.adapted_base.parameters() if p.requires_grad]
        return [
            {"params": head_parameters, "lr": learning_rate},
            {"params": adapter_parameters, "lr": learning_rate / self.joint.head_lr_multiple},
        ]

    def begin_step(self, step: int, total_steps: int) -> dict[str, float]:
        self.head_loss_weight = head_loss_weight(
            step, total_steps, self.joint.peak_lambda0(), self.joint.lambda0_warmup_ratio
        )
        return {"head_loss_weight": self.head_loss_weight}

    def saved_parameters(self) -> list[nn.Parameter]:
        return [*self.head.parameters(), *(p for p in self.adapted_base.parameters() if p.requires_grad)]

    def save_head(self, head_dir: Path, extra: dict) -> None:
        """The heads with ``save_pretrained``, and the adapter with peft's ``save_pretrained``
        (safetensors) in ``head_dir/adapter``, where loading a joint head looks for it."""
        self.head.save_pretrained(head_dir, extra=extra)
        self.adapted_base.save_pretrained(str(Path(head_dir) / ADAPTER_DIR), safe_serialization=True)
