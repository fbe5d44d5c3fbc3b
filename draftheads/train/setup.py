"""Setting a training run up, before its first step: check the config against its recipe, join
the process group, lock the output directory, load base and data, build the head, its recipe and
the DeepSpeed engine, and restore the newest intact checkpoint if ``train.resume``."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from functools import partial
from pathlib import Path

import torch

from draftheads.base_model import load_base
from draftheads.base_skeleton import load_base_skeleton
from draftheads.config import RunConfig, TrainConfig
from draftheads.settings import ConfigError, to_dict
from draftheads.storage import write_text_atomically
from draftheads.train import checkpoint
from draftheads.train.batching import BatchStream, fixed_batches
from draftheads.train.data_history import plan_data_history
from draftheads.train.decode_eval import prepare_continuations
from draftheads.train.engine import build_deepspeed_config, build_engine, resolve_precision
from draftheads.train.initial_head import initial_head
from draftheads.train.output_dir import lock_output_dir
from draftheads.train.process_group import init_distributed
from draftheads.train.recipe import recipe_for
from draftheads.train.reporting import Reporter, log_rank0
from draftheads.train.restore import choose_resume_checkpoint, needs_universal_load, restore
from draftheads.train.run_dir import DATA_REPORT_NAME
from draftheads.train.training_run import TrainingRun


def runs_base_layers(run: RunConfig) -> bool:
    """Whether the run needs the base's decoder layers: for online hidden states, the decode
    evaluation's continuations, or a head initialised from the base's last layer. An offline run
    (``data.features``) without those loads a skeleton base (``draftheads.base_skeleton``) and
    reports no base throughput (``train.base_throughput_batches``)."""
    from_base = bool(getattr(run.head, "init_from_base", False))
    return not run.data.features or run.train.decode_eval_prompts > 0 or from_base


def total_optimizer_steps(train: TrainConfig, batches_per_epoch: int, world_size: int = 1) -> int:
    """``train.max_steps``, or the steps that read ``train.epochs`` epochs of ``batches_per_epoch``
    micro-batches (all ranks together) at ``world_size`` x accumulation micro-batches a step."""
    if train.epochs is None:
        return train.max_steps
    per_step = train.gradient_accumulation_steps * world_size
    return max(1, math.ceil(train.epochs * batches_per_epoch / per_step))


def planned_steps(train: TrainConfig, stream: BatchStream, world_size: int, rank: int) -> int:
    """The run's optimizer steps (``total_optimizer_steps``); rank 0 warns about a warmup longer
    than the run and says when there is no step at all."""
    total_steps = total_optimizer_steps(train, stream.batches_per_epoch(), world_size)
    if 0 < total_steps < train.warmup_steps and rank == 0:
        warnings.warn(
            f"train.warmup_steps ({train.warmup_steps}) exceeds the run's {total_steps} optimizer steps "
            f"(train.max_steps / train.epochs): the learning rate never reaches train.learning_rate "
            f"({train.learning_rate}), only {total_steps / train.warmup_steps:.0%} of it",
            stacklevel=3,
        )
    if total_steps == 0:
        log_rank0(rank, "train.max_steps=0: no training step; the starting head is evaluated and exported")
    return total_steps


def load_datasets(run: RunConfig, tokenizer, rank: int, world_size: int = 1):
    """(train, validation) from the data pipeline; the build report goes next to the run. Rank 0
    builds first and the others then read its cache: every rank holds the whole dataset (its
    ``BatchStream`` picks the rank's batches), and two ranks building one cache would collide."""
    from draftheads.data.pipeline import build_datasets  # lazy: data/ imports datasets

    if rank == 0:
        train_dataset, val_dataset, report = build_datasets(run.data, tokenizer, run.model.base)
    if world_size > 1:
        torch.distributed.barrier()
    if rank != 0:
        train_dataset, val_dataset, report = build_datasets(run.data, tokenizer, run.model.base)
    log_rank0(
        rank,
        f"data: {report.train_examples} train / {report.validation_examples} validation examples, "
        f"{report.assistant_tokens} of {report.tokens} tokens supervised",
    )
    if rank == 0:
        output_dir = Path(run.train.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(
            output_dir / DATA_REPORT_NAME, json.dumps(dataclasses.asdict(report), indent=2) + "\n"
        )
    return train_dataset, val_dataset


def start(run: TrainingRun, latest: Path | None, restart_data: bool) -> None:
    """Restore checkpoint ``latest`` (None: a fresh start), write the run config beside the run
    and open its reporter."""
    config, output_dir = run.config, run.output_dir
    if latest is not None:
        restore(run, latest, restart_data)
    elif config.train.resume:
        log_rank0(
            run.rank,
            f"train.resume: no checkpoint in {output_dir / checkpoint.CHECKPOINTS_DIR}; starting fresh",
        )
    if run.rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(
            output_dir / "config.json", json.dumps(to_dict(config), indent=2, default=str) + "\n"
        )
    run.reporter = Reporter(
        output_dir,
        config.train.report_to,
        config.train.wandb_project,
        config=to_dict(config),
        resume_step=run.step if latest is not None else None,
        enabled=run.rank == 0,
    )


def build_training_run(
    run: RunConfig,
    rank: int,
    world_size: int,
    device: torch.device,
    base_model,
    tokenizer,
    datasets,
    allow_changed_data: bool,
) -> TrainingRun:
    """``setup`` once the output directory is locked."""
    train = run.train
    recipe_class = recipe_for(run.head)
    dtype = resolve_precision(run, device)
    deepspeed_config = build_deepspeed_config(train, dtype, world_size)
    output_dir = Path(train.output_dir)  # checked and claimed: lock_output_dir
    latest = choose_resume_checkpoint(output_dir, rank, world_size) if train.resume else None
    data_history, restart_data = plan_data_history(
        run, latest, datasets is not None, allow_changed_data, world_size
    )
    if latest is not None and needs_universal_load(latest, world_size):
        deepspeed_config["checkpoint"] = {**deepspeed_config.get("checkpoint", {}), "load_universal": True}

    if base_model is None and runs_base_layers(run):
        base_model, tokenizer = load_base(run.model.base, dtype, device, run.model.attn_implementation)
    elif base_model is None:
        base_model, tokenizer = load_base_skeleton(run.model.base, dtype, device)
        log_rank0(
            rank, "offline: the base's decoder layers are not loaded (the feature cache holds their output)"
        )
    elif base_model.dtype != dtype:
        raise ConfigError(f"the given base model is {base_model.dtype} but the run trains in {dtype}")
    base_model.eval().requires_grad_(False)
    train_dataset, val_dataset = datasets or load_datasets(run, tokenizer, rank, world_size)
    pad_token_id = (
        (tokenizer.pad_token_id if tokenizer is not None else None) or base_model.config.pad_token_id or 0
    )
    # Before the recipe and the engine: rank 0 alone generates, so nothing may be partitioned yet
    # (ZeRO-3 partitions what the engine holds, Medusa-2's base included), and Medusa-2's adapter
    # (zero at the start) is not in the base yet.
    decode_sequences = None
    if train.decode_eval_prompts:
        decode_sequences = prepare_continuations(
            run, base_model, tokenizer, pad_token_id, rank, world_size, partial(log_rank0, rank)
        )

    head = initial_head(run, base_model, train_dataset)
    if train.gradient_checkpointing:
        head.gradient_checkpointing_enable()
    recipe = recipe_class.build(
        run,
        base_model,
        head,
        tokenizer=tokenizer,
        splits={"train": train_dataset, "validation": val_dataset},
        dtype=dtype,
        log=partial(log_rank0, rank),
    )

    stream = BatchStream(
        train_dataset,
        train.micro_batch_size,
        pad_token_id,
        train.seed,
        train.group_by_length,
        rank,
        world_size,
    )
    total_steps = planned_steps(train, stream, world_size, rank)
    engine = build_engine(recipe, train, deepspeed_config, total_steps, device)

    validation = fixed_batches(
        val_dataset, train.micro_batch_size, pad_token_id, train.seed, train.eval_batches
    )
    if len(validation) < world_size:  # every rank needs a share to join the all-reduce
        validation = (validation * world_size)[:world_size]
    training_run = TrainingRun(
        config=run,
        rank=rank,
        world_size=world_size,
        device=device,
        output_dir=output_dir,
        base_model=base_model,
        recipe=recipe,
        engine=engine,
        stream=stream,
        eval_batches=validation[rank::world_size],
        reporter=None,  # set below, once the resume step is known
        total_steps=total_steps,
        train_examples=len(train_dataset),
        data_history=data_history,
        decode_sequences=decode_sequences,
    )
    start(training_run, latest, restart_data)
    return training_run


def check_gradient_checkpointing(run: RunConfig) -> None:
    """ConfigError when ``train.gradient_checkpointing`` asks a kind that has nothing to recompute."""
    from draftheads.heads.base import HEAD_REGISTRY

    head_class = HEAD_REGISTRY[run.head.kind]
    if run.train.gradient_checkpointing and not head_class.supports_gradient_checkpointing:
        supported = sorted(kind for kind, cls in HEAD_REGISTRY.items() if cls.supports_gradient_checkpointing)
        raise ConfigError(
            f"train.gradient_checkpointing: true recomputes unrolled draft passes, which only "
            f"{', '.join(supported)} heads have; head.kind is '{run.head.kind}'"
        )


def setup(
    run: RunConfig,
    base_model=None,
    tokenizer=None,
    datasets=None,
    allow_changed_data: bool = False,
    overwrite: bool = False,
) -> TrainingRun:
    """Check the config against its recipe, join the process group, lock the output directory,
    load base and data, build the head, its recipe and the DeepSpeed engine, and restore the
    newest intact checkpoint if ``train.resume``.

    Args:
        base_model, tokenizer: preloaded base (tests); default ``load_base(run.model.base)``.
        datasets: ``(train, validation)`` datasets.Dataset with input_ids/loss_mask rows; default
            ``draftheads.data.pipeline.build_datasets(run.data, tokenizer, run.model.base)``.
        allow_changed_data: resume although ``data.*`` or the batch size changed (the data
            history records it); otherwise that is refused like any other changed setting.
        overwrite: train again into a finished run's directory (``train/run_dir.py``), replacing
            its head, metrics.jsonl and config.json; otherwise that is refused.
    """
    if run.head is None:
        raise ConfigError("head: missing; add a 'head:' section with a 'kind' (e.g. kind: medusa)")
    recipe_for(run.head).check(run)
    check_gradient_checkpointing(run)
    rank, world_size, device = init_distributed()
    lock = lock_output_dir(run.train, overwrite, rank, world_size)
    try:
        training_run = build_training_run(
            run, rank, world_size, device, base_model, tokenizer, datasets, allow_changed_data
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    training_run.lock = lock
    return training_run
