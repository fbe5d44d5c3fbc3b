"""Medusa-2: the heads and a LoRA adapter on the base train together (Medusa paper section 2.2.2).

L = L_base + lambda0(step) * sum_k 0.8^k CE_k, where L_base is either
- ``lm``: next-token CE of the adapted base on assistant tokens (real data), or
- ``kl``: KL(p_original || p_adapted) on assistant tokens (self-distilled data), the teacher being
  the same model with its adapter disabled (peft ``disable_adapter()``: no second copy in memory).
The head loss reads the adapted base's hidden states and its gradient reaches the adapter too:
the base learns to be predictable by its heads while L_base keeps it close to itself.

The adapter is peft's LoRA (rank, alpha, dropout, target modules from ``JointConfig``); the heads
train at ``train.learning_rate``, the adapter at ``learning_rate / joint.head_lr_multiple``
(the reference's ``medusa_lr_multiplier`` of 4).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from draftheads.config import LAMBDA0_BY_BASE_LOSS, JointConfig
from draftheads.settings import ConfigError
from draftheads.train.losses import cross_entropy, kl_divergence, masked_mean
from draftheads.train.objective import ObjectiveOutput, SupervisedTokens, compute_objective, ones_like_rows

BASE_LOSSES = tuple(LAMBDA0_BY_BASE_LOSS)


def is_joint(head_config) -> bool:
    """Does this head train jointly with the base? Head kinds that can declare a ``joint`` field."""
    return bool(getattr(head_config, "joint", False))


def check_joint_config(joint: JointConfig) -> None:
    """Refuse values that cannot work, naming the field (ConfigError)."""
    if joint.base_loss not in BASE_LOSSES:
        raise ConfigError(f"joint.base_loss must be one of {BASE_LOSSES}, got '{joint.base_loss}'")
    if joint.lora_rank < 1:
        raise ConfigError(f"joint.lora_rank must be >= 1, got {joint.lora_rank}")
    if not 0.0 <= joint.lora_dropout < 1.0:
        raise ConfigError(f"joint.lora_dropout must be in [0, 1), got {joint.lora_dropout}")
    if not joint.head_lr_multiple > 0:
        raise ConfigError(f"joint.head_lr_multiple must be > 0, got {joint.head_lr_multiple}")
    if joint.lambda0 is not None and joint.lambda0 < 0:
        raise ConfigError(f"joint.lambda0 must be >= 0 (or null for the default), got {joint.lambda0}")
    if not 0.0 <= joint.lambda0_warmup_ratio <= 1.0:
        raise ConfigError(f"joint.lambda0_warmup_ratio must be in [0, 1], got {joint.lambda0_warmup_ratio}")


def head_loss_weight(step: int, total_steps: int, peak: float, warmup_ratio: float) -> float:
    """lambda0 at optimiser step ``step``: peak * sin(pi/2 * step / ramp) over the first
    ramp = warmup_ratio * total_steps steps, then peak (the Medusa reference's "sine" scheduler)."""
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


class JointObjectiveModule(nn.Module):
    """The LoRA-adapted base and the heads as one module, so one DeepSpeed engine trains both.

    ``forward`` takes the same arguments as ``loop.ObjectiveModule`` with ``hidden_states`` None:
    it runs the adapted base itself. ``head_loss_weight`` is lambda0 for the current step; the
    loop sets it before each optimiser step (``head_loss_weight()`` above).
    """

    def __init__(self, adapted_base, head: nn.Module, base_loss: str, token_fraction: float = 1.0):
        super().__init__()
        if base_loss not in BASE_LOSSES:
            raise ValueError(f"base_loss must be one of {BASE_LOSSES}, got '{base_loss}'")
        self.adapted_base = adapted_base  # PeftModel; only its LoRA weights require grad
        self.head = head
        self.base_loss_kind = base_loss
        self.head_loss_weight = 0.0
        self.token_fraction = token_fraction  # of supervised tokens the heads score (not the base loss)

    def parameter_groups(self, learning_rate: float, head_lr_multiple: float) -> list[dict]:
        """AdamW groups: the heads at ``learning_rate``, the adapter at ``learning_rate / multiple``."""
        head_parameters = [p for p in self.head.parameters() if p.requires_grad]
        adapter_parameters = [p for p in self.adapted_base.parameters() if p.requires_grad]
        return [
            {"params": head_parameters, "lr": learning_rate},
            {"params": adapter_parameters, "lr": learning_rate / head_lr_multiple},
        ]

    def _body(self, input_ids, attention_mask):
        causal_lm = self.adapted_base.get_base_model()  # the HF model, LoRA layers injected
        return causal_lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False
        )

    def forward(self, hidden_states, input_ids, loss_mask, attention_mask) -> ObjectiveOutput:
        if hidden_states is not None:
            raise ValueError("joint training runs the base itself; pass hidden_states=None")
        lm_head = self.adapted_base.get_base_model().get_output_embeddings()
        hidden_states = self._body(input_ids, attention_mask).hidden_states  # L + 1 x (B, T, h)
        tokens = SupervisedTokens.from_masks(loss_mask, attention_mask)
        batch, rows = tokens.predicted_from(1)  # row q - 1 predicts token q
        student_logits = lm_head(hidden_states[-1][batch, rows])  # (M, V)
        if self.base_loss_kind == "lm":
            per_token = cross_entropy(student_logits, input_ids[batch, rows + 1])  # (M,)
        else:
            with torch.no_grad(), self.adapted_base.disable_adapter():
                teacher_hidden = self._body(input_ids, attention_mask).hidden_states[-1]  # (B, T, h)
                teacher_logits = lm_head(teacher_hidden[batch, rows])  # (M, V)
            per_token = kl_divergence(teacher_logits, student_logits)  # (M,)
        base_loss = masked_mean(per_token, ones_like_rows(per_token))
        heads = compute_objective(
            self.head, hidden_states, input_ids, loss_mask, attention_mask, self.token_fraction
        )
        heads.loss = base_loss + self.head_loss_weight * heads.loss
        heads.base_loss = base_loss
        return heads
