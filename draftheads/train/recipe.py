"""What a run trains, behind one interface that the training loop drives without asking which.

A recipe is the module the DeepSpeed engine wraps: ``forward(batch, split) -> ObjectiveOutput``
gives one micro-batch's loss and per-step accuracy. A few more members say the rest of what differs
between ways of training a head: which parameters train at which learning rate
(``parameter_groups``), what a checkpoint leaves out (``exclude_frozen``), what changes from one
optimiser step to the next (``begin_step``) and what is written at the end (``saved_parameters``,
``save_head``); ``check`` refuses settings the recipe cannot train before anything loads.

- ``FrozenBaseRecipe`` (Medusa-1, EAGLE, EAGLE-3, MTP, DFlash): the base stays frozen and only the
  head trains, on hidden states from the base's forward (online) or a feature cache (offline);
  ``train.autocast`` runs the head's training forward (not the base's) under ``torch.autocast``.
- ``JointRecipe`` (Medusa-2, ``draftheads.train.joint``): a LoRA adapter on the base trains with
  the heads (Cai et al. 2024, "Medusa", sec. 2.2.2).

``recipe_for(head_config)`` looks the recipe up in ``RECIPES``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from draftheads.base_model import DTYPES
from draftheads.config import RunConfig
from draftheads.train.hidden_states import HiddenStateSource, OnlineHiddenStates, open_feature_cache
from draftheads.train.joint import JointRecipe
from draftheads.train.objective import ObjectiveOutput, compute_objective
from draftheads.train.supervision import training_supervision


class Recipe(Protocol):
    """What the training loop uses of a recipe, besides its being an ``nn.Module``."""

    exclude_frozen: bool  # save checkpoints without frozen parameters (they never change)
    head: nn.Module  # the draft head it trains (what decoding drafts with)

    @staticmethod
    def check(run: RunConfig) -> None:
        """Raise ConfigError for settings this recipe cannot train."""

    @classmethod
    def build(
        cls,
        run: RunConfig,
        base_model,
        head: nn.Module,
        *,
        tokenizer,
        splits: dict,
        dtype: torch.dtype,
        log: Callable[[str], None],
    ) -> Recipe:
        """The recipe for ``head`` (initialised) on ``base_model`` (frozen, eval mode);
        ``splits``: "train" / "validation" -> the datasets the batches come from."""

    def __call__(self, batch: dict, split: str) -> ObjectiveOutput:
        """Loss and per-step accuracy on ``batch`` (collated rows: input_ids, loss_mask,
        attention_mask, each (B, T); row_index (B,); in training, ``sample_seed``: the int that
        seeds the batch's random draws) of ``split`` ("train" or "validation")."""

    def host_inputs(self, host_batch: dict) -> dict:
        """What a training forward on ``host_batch`` needs that the host can make before the batch
        moves to the device, as more batch entries: ``supervision``, what it scores
        (``draftheads.train.supervision``), and a feature cache's rows."""

    def parameter_groups(self, learning_rate: float) -> list[dict]:
        """AdamW parameter groups; a group without ``lr`` trains at ``learning_rate``."""

    def begin_step(self, step: int, total_steps: int) -> dict[str, float]:
        """Set what depends on the optimiser step; return it, to be logged with the step."""

    def saved_parameters(self) -> list[nn.Parameter]:
        """The parameters ``save_head`` writes (gathered first under ZeRO-3)."""

    def save_head(self, head_dir: Path, extra: dict) -> None:
        """Write the trained head (and whatever decoding needs with it) to ``head_dir``."""


class FrozenBaseRecipe(nn.Module):
    """Only the head trains; the base is frozen. The hidden-state source holds the base without
    registering it, so the engine holds (and ZeRO partitions) the head's parameters alone."""

    exclude_frozen = False

    def __init__(
        self,
        head: nn.Module,
        hidden_states: HiddenStateSource,
        token_fraction: float = 1.0,
        autocast: torch.dtype | None = None,
    ):
        super().__init__()
        self.head = head
        self.hidden_states = hidden_states
        self.token_fraction = token_fraction
        self.autocast = autocast  # the training forward's autocast dtype; None: the weights' dtype

    @staticmethod
    def check(run: RunConfig) -> None:
        pass  # a feature cache is checked against the run when it is opened

    @classmethod
    def build(cls, run, base_model, head, *, tokenizer, splits, dtype, log) -> FrozenBaseRecipe:
        if run.data.features:
            features, max_length = run.data.features, run.data.max_length
            hidden_states = open_feature_cache(
                features, base_model, run.model.base, tokenizer, head, splits, max_length, dtype
            )
            log(f"offline: hidden states {list(hidden_states.cache.layers)} from {features}")
        else:
            hidden_states = OnlineHiddenStates(base_model, tuple(head.required_hidden_states))
        autocast = None if run.train.autocast == "none" else DTYPES[run.train.autocast]
        return cls(head, hidden_states, run.train.loss_token_fraction, autocast)

    def forward(self, batch: dict, split: str) -> ObjectiveOutput:
        hidden_states = self.hidden_states(batch, split)  # the base's own precision, never autocast
        autocast = self.autocast if split == "train" else None  # evaluation computes as decoding does
        device_type = batch["input_ids"].device.type
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            return compute_objective(
                self.head,
                hidden_states,
                batch["input_ids"],
                batch["loss_mask"],
                batch["attention_mask"],
                self.token_fraction,
                batch.get("sample_seed"),
                base_argmax=self.hidden_states.base_argmax(batch, split),
                supervision=batch.get("supervision"),
            )

    def host_inputs(self, host_batch: dict) -> dict:
        supervision = training_supervision(self.head, host_batch, self.token_fraction)
        return {**self.hidden_states.host_inputs(host_batch, "train"), "supervision": supervision}

    def parameter_groups(self, learning_rate: float) -> list[dict]:
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def begin_step(self, step: int, total_steps: int) -> dict[str, float]:
        return {}

    def saved_parameters(self) -> list[nn.Parameter]:
        return list(self.head.parameters())

    def save_head(self, head_dir: Path, extra: dict) -> None:
        self.head.save_pretrained(head_dir, extra=extra)


# How a head trains -> its recipe. Only Medusa heads declare ``joint`` (Medusa-2).
RECIPES: dict[str, type[Recipe]] = {"frozen": FrozenBaseRecipe, "joint": JointRecipe}


def recipe_for(head_config) -> type[Recipe]:
    """The recipe class that trains heads configured by ``head_config``."""
    return RECIPES["joint" if getattr(head_config, "joint", False) else "frozen"]
