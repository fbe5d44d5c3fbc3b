"""What one training run holds while it runs (``TrainingRun``) and reports when it ends
(``TrainingSummary``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftheads.config import RunConfig
from draftheads.train.batching import BatchStream
from draftheads.train.decode_eval import Sequences
from draftheads.train.lock import OutputLock
from draftheads.train.metrics import EvalResult
from draftheads.train.recipe import Recipe
from draftheads.train.reporting import Reporter


@dataclass
class TrainingSummary:
    """What a finished run reports (also stored in the exported head's config.json)."""

    steps: int
    tokens: int
    wall_seconds: float  # this invocation, setup to export
    train_seconds: float  # time in training steps over the whole run (resumes included)
    tokens_per_second: float
    base_forward_tokens_per_second: float | None
    data_source: str
    train_examples: int
    eval: dict | None
    head_dir: str
    # Every data source the head trained on, in order: [{from_step, source, settings}, ...]; more
    # than one when a resume went on with other data (``allow_changed_data``).
    data_history: list[dict] = dataclasses.field(default_factory=list)


@dataclass
class TrainingRun:
    """One training run's state: what setup() builds and train_steps()/save()/cleanup() use and
    advance; nothing lives on the model or in globals."""

    config: RunConfig  # the settings the run was started with
    rank: int
    world_size: int
    device: torch.device
    output_dir: Path
    base_model: Any
    recipe: Recipe  # what trains and how (recipe.py); the engine wraps it
    engine: Any
    stream: BatchStream
    eval_batches: list[dict]
    reporter: Reporter | None
    total_steps: int
    train_examples: int
    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    last_eval: EvalResult | None = None
    last_eval_step: int = -1
    # The decode evaluation's sequences (train.decode_eval_prompts; decode_eval.py), None when off.
    decode_sequences: Sequences | None = None
    data_history: list[dict] = dataclasses.field(default_factory=list)  # see TrainingSummary.data_history
    lock: OutputLock | None = None  # rank 0 holds the output directory's lock for the whole run
