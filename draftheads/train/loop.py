"""The training loop: setup -> train -> save -> cleanup, in one place you can read.

What trains, and on what, is the run's recipe (``draftheads.train.recipe``), the module a
DeepSpeed engine wraps (ZeRO 0-3 from ``configs/deepspeed/``): the draft head on the frozen base's
hidden states, computed online for every batch or read from a feature cache (``data.features``),
or, for Medusa-2 (``head.joint: true``), the heads with a LoRA adapter on the base
(``draftheads.train.joint``). The loop below never asks which.
On a CPU the same code runs as a single gloo process; on GPUs launch it with
``deepspeed --num_gpus N $(which draftheads) train --config FILE``.

Each default lives once, in ``draftheads.config.TrainConfig``, which also refuses values that
cannot work: the DeepSpeed JSON carries only what TrainConfig does not own (ZeRO stage, bucket
sizes, ...); batch sizes, accumulation, clipping and precision are filled in from TrainConfig.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

import draftheads
from draftheads.base_model import DTYPES, load_base, resolve_dtype
from draftheads.base_skeleton import load_base_skeleton
from draftheads.config import RunConfig, TrainConfig
from draftheads.distributed import apply_timeout_to_every_group, distributed_timeout, free_port, local_device
from draftheads.heads.base import CONFIG_NAME, RUN_HEAD_DIR
from draftheads.machine import native_bf16
from draftheads.settings import ConfigError, to_dict
from draftheads.storage import write_text_atomically
from draftheads.train import checkpoint, elastic
from draftheads.train.batching import BatchStream, batch_tokens, fixed_batches
from draftheads.train.decode_eval import Sequences, decode_acceptance, prepare_continuations
from draftheads.train.lock import LOCK_NAME, OutputLock
from draftheads.train.metrics import (
    DecodeEvalResult,
    EvalResult,
    base_forward_tokens_per_second,
    evaluate,
)
from draftheads.train.recipe import Recipe, recipe_for
from draftheads.train.reporting import Reporter, plot_curves
from draftheads.train.resume import check_resume, data_segment, run_record, unrecorded_settings
from draftheads.train.run_dir import DATA_REPORT_NAME, check_output_dir, claim_output_dir
from draftheads.train.schedule import build_scheduler

HEAD_DIR = RUN_HEAD_DIR  # the final head, under the output directory (what --heads <run dir> finds)
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


# ---- configuration that needs the device or files ------------------------------------------------


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


# ---- distributed setup ----------------------------------------------------------------------------


PORT_ATTEMPTS = 5  # local ports tried by a run without a launcher


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, without a launcher, create) the process group; return (rank, world size, device).

    The ``deepspeed`` launcher (or ``torchrun``) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; a plain
    ``draftheads train`` becomes rank 0 of 1 on a free local port. Collectives fail after
    ``draftheads.distributed.distributed_timeout()``, on the world group and on the groups
    DeepSpeed makes for gradients and ZeRO alike. The group lives until the process exits:
    DeepSpeed caches its groups, so it cannot be torn down and rebuilt in-process.
    """
    import deepspeed

    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = local_device()
    timeout = distributed_timeout()
    apply_timeout_to_every_group(timeout)  # DeepSpeed's own groups, made later, too
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Alone, the port was free when chosen but another process may take it before the store
    # listens on it: choose again (a launcher's MASTER_PORT is the launcher's to choose).
    for attempt in range(PORT_ATTEMPTS):
        try:
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            break
        except torch.distributed.DistNetworkError:
            if not alone or attempt == PORT_ATTEMPTS - 1:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


# ---- pieces of the loop ---------------------------------------------------------------------------


def init_from_saved_head(head, directory: str, base_model, token_counts: torch.Tensor | None = None) -> None:
    """Copy a saved head's weights (and buffers, e.g. EAGLE-3's vocabulary maps) into ``head``
    (``train.init_head``); refused unless the saved head is the same kind with the same settings
    (a ``GROWABLE`` one may be larger here: the head grows the saved weights, choosing what it adds
    from ``token_counts`` where that depends on the data) and fits ``base_model``."""
    from draftheads.heads import HeadMismatchError, load_head
    from draftheads.heads.base import GROWABLE, INIT_ONLY, TRAINING_ONLY

    where = f"train.init_head={directory}"
    try:
        saved = load_head(directory)
        saved.base_spec.check_fits(base_model.config, where=where)
    except (FileNotFoundError, ValueError, HeadMismatchError) as err:
        raise ConfigError(f"{where}: {err}") from err
    if saved.kind != head.kind:
        raise ConfigError(f"{where}: a '{saved.kind}' head, but head.kind is '{head.kind}'")
    for field in dataclasses.fields(head.config):
        if any(field.metadata.get(key) for key in (INIT_ONLY, GROWABLE, TRAINING_ONLY)):
            # INIT_ONLY: it chose the first weights, replaced here; GROWABLE: load_saved checks;
            # TRAINING_ONLY: it shapes this run's loss, not the saved weights
            continue
        ours, theirs = getattr(head.config, field.name), getattr(saved.config, field.name)
        if ours != theirs:
            raise ConfigError(f"{where}: its head.{field.name} is {theirs!r}, this run's is {ours!r}")
    try:
        head.load_saved(saved, token_counts)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err


def supervised_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """(V,) how often each token is a supervised target (loss_mask 1) in ``dataset``; heads build
    data-dependent state from it (EAGLE-3's draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"]):
        ids = torch.as_tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids[torch.as_tensor(mask, dtype=torch.bool)], minlength=vocab_size)[
            :vocab_size
        ]
    return counts


def total_optimizer_steps(train: TrainConfig, batches_per_epoch: int, world_size: int = 1) -> int:
    """``train.max_steps``, or the steps that read ``train.epochs`` epochs of ``batches_per_epoch``
    micro-batches (all ranks together) at ``world_size`` x accumulation micro-batches a step."""
    if train.epochs is None:
        return train.max_steps
    per_step = train.gradient_accumulation_steps * world_size
    return max(1, math.ceil(train.epochs * batches_per_epoch / per_step))


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


def _log_rank0(rank: int, message: str) -> None:
    if rank == 0:
        from tqdm import tqdm

        tqdm.write(f"[draftheads] {message}")


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
    _log_rank0(
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


# ---- setup -> train -> save -> cleanup -------------------------------------------------------------


def _lock_and_claim(train: TrainConfig, overwrite: bool) -> OutputLock:
    """Check ``train.output_dir`` (``train/run_dir.py``), lock it, check again under the lock (a
    run may have finished meanwhile) and mark it as this run's. The first check comes before the
    lock file is written, so a directory that is refused gains nothing."""
    output_dir = Path(train.output_dir)
    check_output_dir(output_dir, train.resume, overwrite)
    lock = OutputLock.acquire(output_dir)
    try:
        check_output_dir(output_dir, train.resume, overwrite)
        claim_output_dir(output_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def lock_output_dir(train: TrainConfig, overwrite: bool, rank: int, world_size: int) -> OutputLock | None:
    """Rank 0 checks, locks and claims ``train.output_dir`` for the run; every rank learns whether
    it could, so that all stop together, with rank 0's error, when it is refused or another run
    holds it. Returns rank 0's lock."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = _lock_and_claim(train, overwrite)
        except (ConfigError, FileExistsError) as err:  # OutputDirLockedError, OutputDirRefusedError
            refusal = err
    if world_size > 1:
        shared = [refusal]
        torch.distributed.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal is not None:
        raise refusal
    check_shared_output_dir(Path(train.output_dir), rank, world_size)
    return lock


def check_shared_output_dir(output_dir: Path, rank: int, world_size: int) -> None:
    """Every rank must see the files rank 0 writes under ``train.output_dir``: a checkpoint is
    committed by rank 0, which lists, hashes and renames the files each rank saved there, so ranks
    on nodes without one shared filesystem would leave checkpoints that cannot be resumed. Each
    rank reads rank 0's lock file (just written) and compares it with what rank 0 holds; any rank
    that cannot see it stops every rank with one line, before the base loads."""
    if world_size == 1:
        return
    lock_path = output_dir / LOCK_NAME
    expected = [lock_path.read_text() if rank == 0 else None]
    torch.distributed.broadcast_object_list(expected, src=0)
    seen = lock_path.read_text() if lock_path.is_file() else None
    blind = [None] * world_size
    torch.distributed.all_gather_object(blind, seen != expected[0])
    missing = [str(index) for index, is_blind in enumerate(blind) if is_blind]
    if missing:
        raise ConfigError(
            f"train.output_dir: rank(s) {', '.join(missing)} do not see {lock_path}, which rank 0 wrote; "
            "every rank must write checkpoints to one filesystem they all share (on several nodes, "
            "a network filesystem mounted at the same path)"
        )


def choose_resume_checkpoint(output_dir: Path, rank: int, world_size: int) -> Path | None:
    """The newest intact checkpoint under ``output_dir`` (None: there is none). Rank 0 verifies
    them against their manifests and sets broken ones aside, with a warning naming each and why;
    every rank gets its answer. No intact checkpoint at all is a ConfigError."""
    answer = [None, None]  # (checkpoint path, refusal)
    if rank == 0:
        try:
            point = checkpoint.find_resume_checkpoint(output_dir)
        except checkpoint.CorruptCheckpointError as err:
            answer = [None, f"train.resume: {err}"]
        else:
            for path, why in point.skipped:
                aside = checkpoint.set_aside(path)
                warnings.warn(
                    f"train.resume: checkpoint {path} is broken ({why}); moved to {aside.name} and "
                    "resuming from the newest intact one",
                    stacklevel=2,
                )
            if point.path is not None and not point.verified:
                warnings.warn(
                    f"train.resume: {point.path} has no {checkpoint.MANIFEST_NAME} (written before "
                    "checkpoints carried one), so it cannot be verified; loading it as it is",
                    stacklevel=2,
                )
            answer = [None if point.path is None else str(point.path), None]
    if world_size > 1:
        torch.distributed.broadcast_object_list(answer, src=0)
    if answer[1] is not None:
        raise ConfigError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def source_range(skip: int, limit: int | None) -> str:
    """Which of a source's usable conversations a run read, for its summary and data history:
    " (first 6000)", " (6000 to 13000)"."""
    if skip == 0:
        return f" (first {limit})" if limit else ""
    return f" ({skip} to {skip + limit})" if limit else f" (from {skip})"


def describe_data(record: dict, given: bool) -> str:
    """The data source of a ``run_record``, for the training record."""
    if given:
        return "given datasets"
    data = record["data"]
    return data["source"] + source_range(data.get("skip", 0), data.get("limit"))


def plan_data_history(
    run: RunConfig, resume_from: Path | None, given: bool, allow_changed_data: bool, world_size: int = 1
) -> tuple[list[dict], bool]:
    """The run's data history and whether the data stream starts over. Resuming compares the
    checkpoint's run config with ``run`` (``train/resume.py``): a changed head, kind or optimiser
    setting is refused; changed data or batch size only with ``allow_changed_data``, and then a new
    segment is recorded and the stream starts over on the new data. Another number of processes
    whose gradient accumulation keeps the global batch changes no batch (``train/elastic.py``)."""
    record = run_record(to_dict(run))
    if resume_from is None:
        return [data_segment(record, 0, describe_data(record, given))], False
    state = checkpoint.read_trainer_state(resume_from)
    saved_config = Path(run.train.output_dir) / "config.json"  # older checkpoints kept it only here
    if "run_config" in state:
        saved = state["run_config"]
    elif saved_config.is_file():
        saved = run_record(json.loads(saved_config.read_text()))
    else:
        warnings.warn(
            f"train.resume: {resume_from} records no run config; the settings cannot be compared",
            stacklevel=2,
        )
        saved = record
    saved = elastic.align_accumulation(saved, record, elastic.written_world_size(state), world_size)
    changes = check_resume(saved, record, allow_changed_data, where=str(resume_from))
    if unchecked := unrecorded_settings(saved, record):
        warnings.warn(
            f"train.resume: {resume_from} does not record {', '.join(unchecked)} (an older draftheads "
            "wrote it), so they cannot be compared; going on with this run's values",
            stacklevel=2,
        )
    history = state.get("data_history") or [data_segment(saved, 0, describe_data(saved, given))]
    if not changes:
        return history, False
    return [*history, data_segment(record, state["step"], describe_data(record, given))], True


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


def runs_base_layers(run: RunConfig) -> bool:
    """Whether the run needs the base's decoder layers: for online hidden states, the decode
    evaluation's continuations, or a head initialised from the base's last layer. An offline run
    (``data.features``) without those loads a skeleton base (``draftheads.base_skeleton``) and
    reports no base throughput (``train.base_throughput_batches``)."""
    from_base = bool(getattr(run.head, "init_from_base", False))
    return not run.data.features or run.train.decode_eval_prompts > 0 or from_base


def initial_head(run: RunConfig, base_model, train_dataset):
    """The head in training mode: built for ``base_model``, then ``train.init_head``'s weights or
    its own start from the data. Its first weights depend only on ``train.seed``, never on the
    rank or the data order."""
    from draftheads.heads import build_head

    seed_everything(run.train.seed)
    try:
        head = build_head(base_model, run.head, run.model.base)
    except (ValueError, IndexError) as err:
        raise ConfigError(f"head ({run.head.kind}): {err}") from err
    if (problem := head.engine_layout_problem()) is not None:
        warnings.warn(f"{problem}; the run goes on", stacklevel=2)
    token_counts = supervised_token_counts(train_dataset, base_model.config.vocab_size)
    if run.train.init_head:
        init_from_saved_head(head, run.train.init_head, base_model, token_counts)
    else:
        head.init_from_data(token_counts)
    return head.train()


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
        _log_rank0(rank, "train.max_steps=0: no training step; the starting head is evaluated and exported")
    return total_steps


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
        _log_rank0(
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
            run, base_model, tokenizer, pad_token_id, rank, world_size, partial(_log_rank0, rank)
        )

    head = initial_head(run, base_model, train_dataset)
    recipe = recipe_class.build(
        run,
        base_model,
        head,
        tokenizer=tokenizer,
        splits={"train": train_dataset, "validation": val_dataset},
        dtype=dtype,
        log=partial(_log_rank0, rank),
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


def start(run: TrainingRun, latest: Path | None, restart_data: bool) -> None:
    """Restore checkpoint ``latest`` (None: a fresh start), write the run config beside the run
    and open its reporter."""
    config, output_dir = run.config, run.output_dir
    if latest is not None:
        restore(run, latest, restart_data)
    elif config.train.resume:
        _log_rank0(
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


def needs_universal_load(path: Path, world_size: int) -> bool:
    """Whether checkpoint ``path`` was partitioned by another number of processes than
    ``world_size``, so that it loads only through a universal conversion (``train/elastic.py``)."""
    written = elastic.written_world_size(checkpoint.read_trainer_state(path))
    return written != world_size and elastic.is_partitioned(path / checkpoint.ENGINE_TAG)


def load_engine_state(run: TrainingRun, path: Path) -> dict:
    """``checkpoint.load_checkpoint`` for this run; a checkpoint partitioned by another number of
    processes is first converted by rank 0 into a temporary universal folder beside it, which
    every rank loads and rank 0 then removes."""
    exclude_frozen = run.recipe.exclude_frozen
    if not needs_universal_load(path, run.world_size):
        return checkpoint.load_checkpoint(run.engine, path, run.rank, exclude_frozen=exclude_frozen)
    universal = elastic.universal_folder(path, checkpoint.TEMP_PREFIX)
    failure = [None]
    if run.rank == 0:
        _log_rank0(run.rank, f"train.resume: converting {path} for {run.world_size} process(es)")
        try:
            elastic.convert_to_universal(path, checkpoint.ENGINE_TAG, universal)
        except ConfigError as err:
            failure = [str(err)]
    if run.world_size > 1:
        torch.distributed.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise ConfigError(failure[0])
    try:
        return checkpoint.load_checkpoint(
            run.engine, path, run.rank, exclude_frozen=exclude_frozen, engine_root=universal
        )
    finally:
        if run.world_size > 1:
            torch.distributed.barrier()
        if run.rank == 0:
            shutil.rmtree(universal, ignore_errors=True)


def restore(run: TrainingRun, path: Path, restart_data: bool = False) -> None:
    """Continue from checkpoint ``path``: engine, RNG, data position and loop counters.
    ``restart_data``: the data or batches changed, so the saved position means nothing for them:
    the stream starts at the beginning of the new data."""
    state = load_engine_state(run, path)
    if restart_data:
        _log_rank0(run.rank, "train.resume: data or batches changed; the data stream starts over")
    else:
        position = state["data_position"]
        if elastic.written_world_size(state) != run.world_size:
            position = elastic.remap_data_position(position, run.world_size, str(path))
        run.stream.load_state_dict(position)
    run.step, run.tokens = state["step"], state["tokens"]
    run.train_seconds = state["train_seconds"]
    run.last_eval = EvalResult.from_dict(state["eval"]) if state["eval"] else None
    run.last_eval_step = state["eval_step"]
    _log_rank0(run.rank, f"resumed from {path} at step {run.step}")


def _decode_evaluate(run: TrainingRun) -> DecodeEvalResult:
    """The recipe's head on the decode evaluation's sequences (``train/decode_eval.py``), through
    the base model that decodes with it (Medusa-2's carries its adapter). Every rank measures the
    same: under ZeRO-3 each of the head's modules gathers its parameters as it runs, and every
    rank makes the same module calls, so the gathers line up."""
    return decode_acceptance(
        run.base_model, run.recipe.head, run.decode_sequences, run.config.train.decode_eval_depth
    )


def _evaluate(run: TrainingRun) -> EvalResult:
    run.engine.eval()
    try:
        result = evaluate(partial(run.engine, split="validation"), run.eval_batches, run.device)
        if run.decode_sequences is not None:
            result = dataclasses.replace(result, decode=_decode_evaluate(run))
    finally:
        run.engine.train()
    run.last_eval, run.last_eval_step = result, run.step
    run.reporter.log({"step": run.step, "eval": result.to_dict()})
    _log_rank0(run.rank, f"step {run.step} eval: {result.summary()}")
    return result


def _global_sum(run: TrainingRun, value: float) -> float:
    if run.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=run.device)
    torch.distributed.all_reduce(tensor)
    return float(tensor)


def _global_tensor_sum(run: TrainingRun, tensor: torch.Tensor) -> torch.Tensor:
    if run.world_size == 1:
        return tensor
    tensor = tensor.clone()
    torch.distributed.all_reduce(tensor)
    return tensor


class NonFiniteLossError(ConfigError):
    """A training step's loss is inf or NaN: the settings (a learning rate too high) or the data
    made the run diverge."""


def stop_on_non_finite_loss(run: TrainingRun, losses: list[torch.Tensor]) -> None:
    """Raise NonFiniteLossError on every rank, before the optimizer step, when a loss of this step
    (``losses``: this rank's micro-batches, detached device scalars) is not finite on any rank: the
    step updates nothing, the checkpoints written so far stay, and no head is saved from diverged
    weights. One host read per optimizer step (all ranks' count of non-finite losses)."""
    non_finite = (~torch.isfinite(torch.stack(losses))).sum().double()
    if float(_global_tensor_sum(run, non_finite)) == 0:
        return
    bad = next((float(loss) for loss in losses if not math.isfinite(float(loss))), None)
    latest = checkpoint.latest_checkpoint(run.output_dir)
    kept = f"the last checkpoint, {latest}, is kept" if latest else "no checkpoint was written yet"
    value = "not finite on another rank" if bad is None else bad
    raise NonFiniteLossError(
        f"step {run.step + 1}: the training loss is {value}"
        f"; stopped before the step updated the head, and no head was saved ({kept}); lower "
        f"train.learning_rate (now {run.config.train.learning_rate}) or check the data"
    )


def train_steps(run: TrainingRun) -> None:
    """Optimiser steps from ``run.step`` to ``run.total_steps``: each is
    ``gradient_accumulation_steps`` micro-batches through the engine's recipe, forward and
    backward."""
    from tqdm import tqdm

    train, engine = run.config.train, run.engine
    accumulation = train.gradient_accumulation_steps
    progress = tqdm(
        total=run.total_steps,
        initial=run.step,
        disable=run.rank != 0,
        dynamic_ncols=True,
        desc="train",
    )
    window_loss, window_parts, window_steps, window_tokens = 0.0, {}, 0, 0
    window_correct = window_counted = None
    window_start = time.perf_counter()
    while run.step < run.total_steps:
        step_values = run.recipe.begin_step(run.step, run.total_steps)  # e.g. Medusa-2's lambda0
        step_losses = []
        for accumulation_index in range(accumulation):
            host_batch = next(run.stream)  # with each row's seed (draftheads.train.draws)
            window_tokens += batch_tokens(host_batch)  # read on the host: nothing waits for the device
            batch = {name: tensor.to(run.device, non_blocking=True) for name, tensor in host_batch.items()}
            output = engine(batch, "train")
            engine.backward(output.loss)
            step_losses.append(output.loss.detach())
            if accumulation_index == accumulation - 1:  # before the boundary's optimizer step
                stop_on_non_finite_loss(run, step_losses)
            engine.step()  # DeepSpeed steps optimizer + scheduler only at the accumulation boundary
            # Metrics stay device tensors until the log step reads them.
            window_loss = window_loss + step_losses[-1].double() / accumulation
            for name, part in output.loss_parts.items():
                window_parts[name] = window_parts.get(name, 0.0) + part.detach().double() / accumulation
            correct, counted = output.top1_correct.detach().double(), output.counted.detach().double()
            window_correct = correct if window_correct is None else window_correct + correct
            window_counted = counted if window_counted is None else window_counted + counted
        run.step += 1
        window_steps += 1
        progress.update(1)

        if run.step % train.log_every == 0 or run.step == run.total_steps:
            elapsed = time.perf_counter() - window_start
            tokens = int(_global_sum(run, window_tokens))
            run.tokens += tokens
            run.train_seconds += elapsed
            # What the step learned from: the mean over every rank's micro-batches, as one
            # process accumulating them all would log it.
            window_loss = _global_sum(run, float(window_loss)) / run.world_size
            window_parts = {
                name: _global_sum(run, float(total)) / run.world_size
                for name, total in sorted(window_parts.items())
            }
            window_correct = _global_tensor_sum(run, window_correct)
            window_counted = _global_tensor_sum(run, window_counted)
            accuracy = (window_correct / window_counted.clamp(min=1)).tolist()
            record = {
                "step": run.step,
                "loss": window_loss / window_steps,
                "top1": accuracy,
                "lr": engine.get_lr()[0],
                "tokens": run.tokens,
                "tokens_per_second": tokens / elapsed,
                **{name: total / window_steps for name, total in window_parts.items()},
                **step_values,
            }
            run.reporter.log(record)
            progress.set_postfix(
                loss=f"{record['loss']:.3f}",
                top1=f"{accuracy[0]:.3f}",
                tok_s=f"{record['tokens_per_second']:.0f}",
            )
            window_loss, window_parts, window_steps, window_tokens = 0.0, {}, 0, 0
            window_correct = window_counted = None
            window_start = time.perf_counter()

        evaluate_now = bool(train.eval_every) and run.step % train.eval_every == 0
        save_now = bool(train.save_every) and run.step % train.save_every == 0
        paused_at = time.perf_counter()
        if evaluate_now:
            _evaluate(run)
        if save_now:
            save(run)
        # Evaluation and checkpoint time is not training throughput, but the steps of the window
        # before them still are: the window's clock skips the pause rather than starting over.
        window_start += time.perf_counter() - paused_at
    progress.close()


def save(run: TrainingRun) -> Path:
    """Checkpoint the current step atomically (every rank takes part)."""
    state = {
        "data_position": run.stream.state_dict(),
        "tokens": run.tokens,
        "train_seconds": run.train_seconds,
        "eval": run.last_eval.to_dict() if run.last_eval else None,
        "eval_step": run.last_eval_step,
        "run_config": run_record(to_dict(run.config)),  # what a resume is compared with
        "data_history": run.data_history,
    }
    return checkpoint.save_checkpoint(
        run.engine,
        run.output_dir,
        run.step,
        state,
        run.config.train.keep_checkpoints,
        run.rank,
        exclude_frozen=run.recipe.exclude_frozen,
    )


def replace_saved_files(staging: Path, head_dir: Path) -> None:
    """Move every file under ``staging`` to the same place under ``head_dir``, each with one
    ``os.replace`` (atomic on one filesystem), the head's config.json last: a reader that finds the
    new config finds the new weights beside it. Whatever else ``head_dir`` holds stays, such as
    ``tune-tree``'s tree.json or the user's own files."""
    files = sorted(path for path in staging.rglob("*") if not path.is_dir())
    files.sort(key=lambda path: path == staging / CONFIG_NAME)  # stable: config.json to the end
    for source in files:
        target = head_dir / source.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)


def _write_head(run: TrainingRun, head_dir: Path, extra: dict) -> None:
    """``recipe.save_head`` into a temporary directory beside ``head_dir``, after a free-space
    check, then its files moved into ``head_dir`` (``replace_saved_files``); a write that runs out
    of space says so and leaves the old head, if any."""
    temporary = head_dir.with_name(checkpoint.TEMP_PREFIX + head_dir.name)
    shutil.rmtree(temporary, ignore_errors=True)
    size = sum(p.numel() * p.element_size() for p in run.recipe.saved_parameters())
    try:
        with checkpoint.space_checked_write(
            run.output_dir, temporary, checkpoint.with_margin(size), f"the trained head {head_dir}"
        ):
            run.recipe.save_head(temporary, extra)
        replace_saved_files(temporary, head_dir)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def export_head(run: TrainingRun, summary: TrainingSummary) -> Path:
    """Write the final head (``save_pretrained``: loadable without DeepSpeed) through the recipe,
    which also writes what decoding needs with it (Medusa-2: the base adapter)."""
    import deepspeed

    head_dir = run.output_dir / HEAD_DIR
    extra = {"training": dataclasses.asdict(summary)}
    if run.engine.zero_optimization_stage() == 3:  # ZeRO-3 partitions parameters: gather first
        with deepspeed.zero.GatheredParameters(run.recipe.saved_parameters(), modifier_rank=None):
            if run.rank == 0:
                _write_head(run, head_dir, extra)
    elif run.rank == 0:
        _write_head(run, head_dir, extra)
    return head_dir


def cleanup(run: TrainingRun | None) -> None:
    """Close the reporters, draw the curves, release the engine and the output directory."""
    if run is None:
        return
    try:
        if run.reporter is not None:
            run.reporter.close()
            if run.rank == 0:
                plot_curves(run.output_dir)
        if run.engine is not None:
            run.engine.destroy()
    finally:
        if run.lock is not None:
            run.lock.release()


def run_training(
    run: RunConfig,
    base_model=None,
    tokenizer=None,
    datasets=None,
    allow_changed_data: bool = False,
    overwrite: bool = False,
) -> TrainingSummary:
    """Train ``run.head`` on ``run.model.base``: setup -> train -> save -> cleanup.

    Returns the summary also stored in ``<output_dir>/head/config.json`` under ``training``.
    ``allow_changed_data``, ``overwrite``: see ``setup``.
    """
    training_run = None
    started = time.perf_counter()
    try:
        training_run = setup(run, base_model, tokenizer, datasets, allow_changed_data, overwrite)
        train_steps(training_run)
        if training_run.last_eval_step != training_run.step:
            _evaluate(training_run)
        final_checkpoint = checkpoint.latest_checkpoint(training_run.output_dir)
        if (
            final_checkpoint is None
            or checkpoint.read_trainer_state(final_checkpoint)["step"] != training_run.step
        ):
            save(training_run)
        base_tokens_per_second = None
        if run.train.base_throughput_batches and runs_base_layers(run):
            timing = BatchStream(
                training_run.stream.dataset,
                run.train.micro_batch_size,
                training_run.stream.pad_token_id,
                run.train.seed,
                run.train.group_by_length,
            )
            batches = [
                next(timing)
                for _ in range(min(run.train.base_throughput_batches, timing.batches_per_epoch()))
            ]
            base_tokens_per_second = base_forward_tokens_per_second(
                training_run.base_model, batches, training_run.device
            )
        tokens_per_second = (
            training_run.tokens / training_run.train_seconds if training_run.train_seconds else 0.0
        )
        summary = TrainingSummary(
            steps=training_run.step,
            tokens=training_run.tokens,
            wall_seconds=time.perf_counter() - started,
            train_seconds=training_run.train_seconds,
            tokens_per_second=tokens_per_second,
            base_forward_tokens_per_second=base_tokens_per_second,
            data_source="given datasets"
            if datasets is not None
            else " + ".join(
                [run.data.source + source_range(run.data.skip, run.data.limit)] + list(run.data.extra_sources)
            ),
            train_examples=training_run.train_examples,
            eval=training_run.last_eval.to_dict() if training_run.last_eval else None,
            head_dir=str(training_run.output_dir / HEAD_DIR),
            data_history=training_run.data_history,
        )
        training_run.reporter.log({"step": training_run.step, "summary": dataclasses.asdict(summary)})
        export_head(training_run, summary)
        ratio = (
            f" ({tokens_per_second / base_tokens_per_second:.2f} of base forward-only)"
            if base_tokens_per_second
            else ""
        )
        _log_rank0(
            training_run.rank,
            f"done: {summary.steps} steps, {summary.tokens} tokens, {tokens_per_second:.0f} tokens/s{ratio}; "
            f"head saved to {summary.head_dir}",
        )
        return summary
    finally:
        cleanup(training_run)
