"""The DeepSpeed engine a run trains through, and what it is built from: the run's one dtype
(``resolve_precision``) and its DeepSpeed config (``build_deepspeed_config``).

Each default lives once, in ``draftheads.config.TrainConfig``, which also refuses values that
cannot work: the DeepSpeed JSON carries only what TrainConfig does not own (ZeRO stage, bucket
sizes, ...); batch sizes, accumulation, clipping and precision are filled in from TrainConfig.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

import draftheads
from draftheads.base_model import DTYPES, resolve_dtype
from draftheads.config import RunConfig, TrainConfig
from draftheads.machine import native_bf16
from draftheads.settings import ConfigError
from draftheads.train.recipe import Recipe
from draftheads.train.schedule import build_scheduler

# DeepSpeed keys that TrainConfig owns (key -> the run-config field to set instead).
OWNED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.micro_batch_size and train.gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "optimizer": "train.learning_rate / train.adam_betas / train.weight_decay",
    "scheduler": "train.warmup_steps / train.min_lr_ratio",
}


def resolve_precision(run: RunConfig, device: torch.device) -> torch.dtype:
    """The one dtype of base model and head. ``auto`` follows ``model.dtype`` (bf16 on GPU, fp32
    on CPU); an explicit ``train.precision`` must agree with an explicit ``model.dtype``."""
    try:
        base_dtype = resolve_dtype(run.model.dtype, device)
    except ValueError as err:
        raise ConfigError(f"model.dtype: {err}") from err
    if run.train.precision == "auto":
        dtype = base_dtype
    else:
        dtype = DTYPES[run.train.precision]
        if run.model.dtype != "auto" and base_dtype != dtype:
            raise ConfigError(
                f"train.precision '{run.train.precision}' disagrees with model.dtype '{run.model.dtype}'; "
                "the head trains in the base model's dtype, so set one of them to auto"
            )
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"training supports fp32 and bf16, not {dtype} (model.dtype '{run.model.dtype}')")
    if run.train.autocast != "none" and dtype != torch.float32:
        raise ConfigError(
            f"train.autocast '{run.train.autocast}' runs a fp32 head's forward in lower precision, but "
            f"the head trains in {dtype} (train.precision '{run.train.precision}', model.dtype "
            f"'{run.model.dtype}'); set train.autocast=none or train.precision=fp32"
        )
    if run.train.autocast == "bf16" and device.type == "cpu" and not native_bf16():
        warnings.warn(
            "train.autocast=bf16 on a CPU without AVX512_BF16 or AMX: bf16 matmuls are emulated and "
            "likely slower than fp32 (lscpu flags)",
            stacklevel=2,
        )
    return dtype


def resolve_deepspeed_path(path: str) -> Path:
    """``train.deepspeed_config`` as given, or relative to the project checkout (configs/...)."""
    candidates = [Path(path)]
    if not Path(path).is_absolute():
        candidates.append(Path(draftheads.__file__).resolve().parents[1] / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"train.deepspeed_config: file not found: {path} (looked in {', '.join(map(str, candidates))})"
    )


def build_deepspeed_config(train: TrainConfig, dtype: torch.dtype, world_size: int) -> dict[str, Any]:
    """The JSON at ``train.deepspeed_config`` with TrainConfig's values filled in."""
    path = resolve_deepspeed_path(train.deepspeed_config)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    for key, owner in OWNED_DEEPSPEED_KEYS.items():
        if key in config:
            raise ConfigError(
                f"{path}: '{key}' is set from {owner} in the run config; remove it from the JSON"
            )
    return {
        **config,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * world_size,
        "gradient_clipping": train.grad_clip,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": config.get("steps_per_print", 2**31 - 1),  # our own logging reports progress
    }


BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size")


def with_buckets_fitted(deepspeed_config: dict, trainable: int) -> dict:
    """``deepspeed_config`` with ZeRO's communication buckets no larger than the trainable
    parameters: DeepSpeed allocates each bucket whole (two with ``overlap_comm``), and its default
    of 5e8 elements is more than a draft head's whole gradient (EAGLE-3 on an 8B base: 4.2e8)."""
    zero = deepspeed_config.get("zero_optimization")
    if not zero:
        return deepspeed_config
    fitted = {key: min(int(zero[key]), trainable) for key in BUCKET_KEYS if key in zero}
    return {**deepspeed_config, "zero_optimization": {**zero, **fitted}}


def build_engine(
    recipe: Recipe, train: TrainConfig, deepspeed_config: dict, total_steps: int, device: torch.device
):
    """The DeepSpeed engine over ``recipe``: AdamW over the recipe's parameter groups and our
    warmup-cosine schedule (it scales every group's LR)."""
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    parameters = [p for p in recipe.parameters() if p.requires_grad]
    deepspeed_config = with_buckets_fitted(deepspeed_config, sum(p.numel() for p in parameters))
    optimizer = torch.optim.AdamW(
        recipe.parameter_groups(train.learning_rate),
        lr=train.learning_rate,
        betas=tuple(train.adam_betas),
        weight_decay=train.weight_decay,
        fused=device.type == "cuda",
    )
    engine, _, _, _ = deepspeed.initialize(
        model=recipe,
        model_parameters=parameters,
        optimizer=optimizer,
        # DeepSpeed calls this with the optimizer it wraps and steps it at each accumulation boundary.
        lr_scheduler=lambda wrapped: build_scheduler(
            wrapped, train.warmup_steps, total_steps, train.min_lr_ratio
        ),
        config=deepspeed_config,
    )
    return engine
