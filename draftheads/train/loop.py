"""The training loop: setup -> train -> save -> cleanup, in one place you can read.

What trains, and on what, is the run's recipe (``draftheads.train.recipe``), the module a
DeepSpeed engine wraps (ZeRO 0-3 from ``configs/deepspeed/``): the draft head on the frozen base's
hidden states, computed online for every batch or read from a feature cache (``data.features``),
or, for Medusa-2 (``head.joint: true``), the heads with a LoRA adapter on the base
(``draftheads.train.joint``). The loop below never asks which.
On a CPU the same code runs as a single gloo process; on GPUs launch it with
``deepspeed --num_gpus N $(which draftheads) train --config FILE``.

``setup`` (``draftheads.train.setup``) builds the run: the process group, the locked output
directory, base, data, head, recipe and DeepSpeed engine (``draftheads.train.engine``), restored
from the newest intact checkpoint on ``train.resume`` (``draftheads.train.restore``). This module
runs its steps, evaluates and checkpoints on schedule, exports the head and cleans up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from functools import partial
from pathlib import Path

import torch

from draftheads.config import RunConfig
from draftheads.heads.base import CONFIG_NAME, RUN_HEAD_DIR
from draftheads.settings import ConfigError, to_dict
from draftheads.train import checkpoint
from draftheads.train.batching import BatchStream, batch_tokens, to_device, with_host_inputs
from draftheads.train.data_history import source_range
from draftheads.train.decode_eval import decode_acceptance
from draftheads.train.metrics import (
    DecodeEvalResult,
    EvalResult,
    base_forward_tokens_per_second,
    evaluate,
)
from draftheads.train.reporting import log_rank0, plot_curves
from draftheads.train.resume import run_record
from draftheads.train.setup import runs_base_layers, setup
from draftheads.train.training_run import TrainingRun, TrainingSummary

HEAD_DIR = RUN_HEAD_DIR  # the final head, under the output directory (what --heads <run dir> finds)


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
    log_rank0(run.rank, f"step {run.step} eval: {result.summary()}")
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
            # With each row's seed (draftheads.train.draws), what the step scores and a cache's rows,
            # all made on the host, as is the token count: nothing here waits for the device.
            host_batch = with_host_inputs(next(run.stream), run.recipe.host_inputs)
            window_tokens += batch_tokens(host_batch)
            batch = to_device(host_batch, run.device)
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
        log_rank0(
            training_run.rank,
            f"done: {summary.steps} steps, {summary.tokens} tokens, {tokens_per_second:.0f} tokens/s{ratio}; "
            f"head saved to {summary.head_dir}",
        )
        return summary
    finally:
        cleanup(training_run)
