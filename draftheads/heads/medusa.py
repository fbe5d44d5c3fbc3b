"""Medusa heads (Cai et al. 2024, arXiv 2401.10774): K parallel heads on the last hidden state.

Head k (0-based) reads the base model's final normed hidden state h_t and predicts the token at
t + k + 2 (the base lm_head itself predicts t + 1). Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` followed by a vocab projection. W and b start at zero, so a fresh head is
exactly the base lm_head. The reference zero-inits W only and writes ``[ResBlock(...)] * n``,
which repeats one module n times (shared weights); here every block is its own module.

Checkpoint names: ``heads.{k}.blocks.{l}.linear.{weight,bias}`` and ``heads.{k}.lm_head.weight``
(absent with ``shared_lm_head``, where every head uses the frozen base lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from draftheads.heads.base import DraftHead, HeadConfig, register_head


@dataclass
class MedusaConfig(HeadConfig):
    kind: ClassVar[str] = "medusa"
    num_heads: int = 4  # K: the paper's Vicuna heads use 4-5
    num_layers: int = 1  # residual blocks per head
    shared_lm_head: bool = False  # True: project with the frozen base lm_head (no per-head copy)
    # Medusa-2: the heads were trained jointly with a LoRA adapter on the base (training options in
    # the run config's ``joint`` section); the head directory then holds the adapter, and the head
    # drafts for (and verifies with) the adapted base (``draftheads.heads.adapter``).
    joint: bool = False

    def __post_init__(self):
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")


class ResidualBlock(nn.Module):
    """``x + SiLU(linear(x))`` with the linear layer zero-initialised (the block starts as identity)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.activation = nn.SiLU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.activation(self.linear(hidden))


class MedusaHeadModule(nn.Module):
    """One Medusa head: residual blocks, then (unless shared) its own vocab projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, own_lm_head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if own_lm_head else None

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


@register_head
class MedusaHead(DraftHead):
    kind = "medusa"
    config_class = MedusaConfig
    drafting = "parallel"

    def __init__(self, config: MedusaConfig, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        hidden_size, vocab_size = base_config.hidden_size, base_config.vocab_size
        self.heads = nn.ModuleList(
            MedusaHeadModule(
                hidden_size, vocab_size, config.num_layers, own_lm_head=not config.shared_lm_head
            )
            for _ in range(config.num_heads)
        )

    def init_from_base(self, base_model) -> None:
        """Each head's own vocab projection starts as a copy of the base lm_head (Medusa paper,
        "Medusa heads")."""
        if self.config.shared_lm_head:
            return
        base_weight = base_model.get_output_embeddings().weight
        with torch.no_grad():
            for head in self.heads:
                head.lm_head.weight.copy_(base_weight)

    @property
    def num_draft_steps(self) -> int:
        return self.config.num_heads

    def head_logits(self, features: torch.Tensor, index: int) -> torch.Tensor:
        """Head ``index``'s logits for features of any leading shape: (..., h) -> (..., V)."""
        head = self.heads[index]
        hidden = head.transform(features)  # (..., h)
        projection = head.lm_head if head.lm_head is not None else self.base_lm_head
        return projection(hidden)  # (..., V)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, h) last hidden states -> (B, T, K, V); entry k predicts the token k + 2 ahead."""
        return torch.stack([self.head_logits(features, k) for k in range(self.config.num_heads)], dim=2)
