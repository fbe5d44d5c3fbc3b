"""Atomic, resumable training checkpoints.

Layout under ``<output_dir>/checkpoints/``::

    step-00000200/
        engine/...               DeepSpeed engine state: head weights, optimizer (ZeRO partitions
                                 per rank), LR scheduler
        rng_state_<rank>.pt      torch / CUDA / python / numpy RNG of each rank
        trainer_state.json       step, data position, token count, last evaluation, run config
        config.json              the head's config, as in <output_dir>/head: the checkpoint
                                 directory loads as a head (draftheads.heads.checkpoint)
        manifest.json            size and sha256 of every file above (written last)

A checkpoint is written into ``.tmp-step-...`` and renamed into place only once complete, so a
crash leaves either the previous checkpoints or the new one, never a half-written directory that
``resume`` would pick up. Only the newest ``keep`` checkpoints are kept. Before writing, the free
space is checked against the checkpoint's expected size, and a write that runs out of space fails
with an error that says so (torch's zip writer reports only ``unexpected pos ...``).

A complete checkpoint can still rot or be damaged afterwards (a copy cut short, a bad disk); the
manifest lets ``resume`` verify it before loading and fall back to the newest intact one.
Checkpoints written before manifests existed load unverified.

Nothing in a checkpoint is unpickled beyond tensors, plain values and the few classes DeepSpeed
saves (``safe_loading``): a file that asks for more (a crafted pickle would run its code on resume)
is refused, naming it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from draftheads.heads.base import CONFIG_NAME, DraftHead
from draftheads.heads.checkpoint import (  # the manifest is read by heads too: it lives there
    CHECKPOINTS_DIR,
    ENGINE_DIR,
    MANIFEST_NAME,  # noqa: F401  (train.restore and the tests name it here)
    TRAINER_STATE_NAME,
    CorruptCheckpointError,
    verify_checkpoint,
    write_manifest,
)
from draftheads.storage import InsufficientSpaceError, check_free_space, format_bytes
from draftheads.train.elastic import written_world_size
from draftheads.train.safe_loading import (
    check_loadable,
    deepspeed_state_classes,
    legacy_rng_globals,
    load_restricted,
    weights_only_loads,
)

ENGINE_TAG = ENGINE_DIR
STATE_NAME = TRAINER_STATE_NAME
TEMP_PREFIX = ".tmp-"
FULL_DISK_SLACK = 2**20  # bytes: a filesystem with less free after a failed write counts as full
CORRUPT_PREFIX = "corrupt-"  # a checkpoint that failed verification, set aside by resume
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (those holding ``trainer_state.json``), oldest first."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.match(path.name)) and (path / STATE_NAME).is_file()
    ]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_NAME).read_text())


# ---- manifest: verify before loading --------------------------------------------------------------


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resumed run loads, and why newer ones were passed over."""

    path: Path | None  # None: no checkpoint at all
    verified: bool = False  # False: written before manifests, loaded unverified
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (newer broken checkpoint, why)


def find_resume_checkpoint(output_dir: str | Path) -> ResumePoint:
    """The newest checkpoint under ``output_dir`` that verifies (or predates manifests and has a
    readable trainer state), with the newer broken ones and why each is broken. Raise
    CorruptCheckpointError when there are checkpoints but none is intact."""
    skipped = []
    for path in reversed(list_checkpoints(output_dir)):
        try:
            verified = verify_checkpoint(path)
            read_trainer_state(path)  # an unverified checkpoint at least needs a readable state
        except (CorruptCheckpointError, OSError, ValueError) as err:
            skipped.append((path, str(err)))
            continue
        return ResumePoint(path, verified, skipped)
    if skipped:
        reasons = "; ".join(f"{path.name}: {why}" for path, why in skipped)
        raise CorruptCheckpointError(
            f"no intact checkpoint to resume from in {Path(output_dir) / CHECKPOINTS_DIR} ({reasons}); "
            "remove them (or set train.resume=false with another train.output_dir) to start afresh"
        )
    return ResumePoint(None)


def set_aside(checkpoint: Path) -> Path:
    """Rename a broken checkpoint out of the way (``corrupt-step-...``) so that neither resume nor
    pruning counts it; it stays on disk for inspection."""
    target = checkpoint.with_name(CORRUPT_PREFIX + checkpoint.name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(checkpoint, target)
    return target


# ---- RNG ------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """This process's torch / CUDA / python / numpy RNG states as tensors and plain values (numpy's
    key array as an int64 tensor), which torch loads with ``weights_only=True``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy

        kind, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        keys = torch.from_numpy(keys.astype(numpy.int64))
        state["numpy"] = (kind, keys, int(position), int(has_gauss), float(cached_gaussian))
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNGs from ``capture_rng_state``'s dict (or an older one, whose numpy key array is an
    ndarray)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
        keys = numpy.asarray(keys.numpy() if torch.is_tensor(keys) else keys, dtype=numpy.uint32)
        numpy.random.set_state((kind, keys, position, has_gauss, cached_gaussian))


# ---- save / load ----------------------------------------------------------------------------------


def _barrier() -> None:
    from torch import distributed

    if distributed.is_available() and distributed.is_initialized():
        distributed.barrier()


def _sum_over_ranks(value: int) -> int:
    from torch import distributed

    if not (distributed.is_available() and distributed.is_initialized()):
        return value
    total = torch.tensor([value], dtype=torch.float64)
    if distributed.get_backend() == "nccl":
        total = total.cuda()
    distributed.all_reduce(total)
    return int(total.item())


def _remove_stale_temporaries(root: Path) -> None:
    for path in root.glob(TEMP_PREFIX + "*"):
        shutil.rmtree(path, ignore_errors=True)


# ---- free space -----------------------------------------------------------------------------------


def directory_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _tensor_bytes(tensors) -> int:
    # ZeRO-3 leaves a partitioned parameter empty here and keeps its full size in ``ds_numel``.
    return sum(getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size() for tensor in tensors)


def engine_state_bytes(engine, exclude_frozen: bool = False, rank: int = 0) -> int:
    """About what ``engine.save_checkpoint`` writes on rank ``rank``: the module's weights and
    buffers (rank 0 writes them; trainable weights only with ``exclude_frozen``) and this rank's
    optimizer state, with the master copies of the weights it keeps (ZeRO partitions, bf16) that
    are not the module's own tensors."""
    module_parameters = list(engine.module.parameters())
    saved = [p for p in module_parameters if p.requires_grad or not exclude_frozen]
    total = _tensor_bytes(saved) + _tensor_bytes(engine.module.buffers()) if rank == 0 else 0
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed wraps torch's
    if optimizer is not None:
        own = {id(p) for p in module_parameters}
        for group in optimizer.param_groups:
            total += _tensor_bytes(p for p in group["params"] if id(p) not in own)
        for state in optimizer.state.values():
            total += _tensor_bytes(value for value in state.values() if torch.is_tensor(value))
    return total


def with_margin(size: int) -> int:
    """The free space a write of about ``size`` bytes asks for: serialisation overhead (zip
    headers, JSON, RNG states) is small next to the tensors, 10% and 1 MiB covers it."""
    return int(size * 1.1) + 2**20


@contextmanager
def space_checked_write(directory: Path, temporary: Path, needed_bytes: int, what: str) -> Iterator[None]:
    """Check the free space for a write of ``needed_bytes`` into ``temporary`` (on the filesystem
    of ``directory``) before it starts, and report a write that still runs out of space (the
    estimate was low, or another process filled the disk) as InsufficientSpaceError.

    A full disk reaches us as an OSError with ENOSPC, or wrapped: torch's zip writer says only
    ``unexpected pos ...`` and safetensors an ``IoError`` string. So any failure after which the
    filesystem has less room than the rest of the write needed, or is all but full (a write fills
    it up to the last block before failing), counts as running out of space. The caller removes
    ``temporary``.
    """
    check_free_space(directory, needed_bytes, what)
    try:
        yield
    except InsufficientSpaceError:
        raise
    except Exception as err:
        free = shutil.disk_usage(directory).free
        written = directory_bytes(temporary) if temporary.is_dir() else 0
        causes = [err, err.__cause__, err.__context__]
        space_errno = any(
            getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or os.strerror(errno.ENOSPC) in str(cause)  # wrapped: safetensors' "... (os error 28)"
            for cause in causes
            if cause is not None
        )
        if space_errno or free < max(needed_bytes - written, FULL_DISK_SLACK):
            raise InsufficientSpaceError(
                errno.ENOSPC,
                f"ran out of space in {directory} while writing {what}: {format_bytes(written)} "
                f"written of about {format_bytes(needed_bytes)}, {format_bytes(free)} free; "
                "free some space or write elsewhere (nothing half-written was kept)",
            ) from err
        raise


# ---- save / load ----------------------------------------------------------------------------------


def write_head_config(engine, directory: Path, step: int, trainer_state: dict[str, Any]) -> None:
    """The head's config.json in a checkpoint (with the training record so far), which makes the
    checkpoint directory loadable as a head (``draftheads.heads.checkpoint``). ``engine.module`` is
    the training recipe, which holds the head as ``head``; an engine without one writes nothing."""
    head = getattr(engine.module, "head", None)
    if not isinstance(head, DraftHead):
        return
    history = trainer_state.get("data_history") or []
    training = {
        "steps": step,
        "tokens": trainer_state.get("tokens"),
        "data_source": history[-1]["source"] if history else "not recorded",
        "eval": trainer_state.get("eval"),
        "data_history": history,
    }
    config = {**head.config_dict(), "training": training}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def save_checkpoint(
    engine,
    output_dir: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    keep: int,
    rank: int = 0,
    exclude_frozen: bool = False,
) -> Path:
    """Write checkpoint ``step`` atomically on every rank (all ranks must call) and prune old ones.

    Args:
        engine: a DeepSpeed engine (anything with ``save_checkpoint(dir, tag=..., ...)``,
            ``module`` and ``optimizer``).
        trainer_state: JSON-serialisable loop state (step, data position, evaluation, ...).
        keep: how many checkpoints to keep (the newest; at least 1).
        exclude_frozen: leave frozen parameters out of the engine state (Medusa-2: the engine's
            module holds the whole base, of which only the LoRA adapter trains).

    Raises InsufficientSpaceError (an OSError) before writing when the free space is short of the
    checkpoint's expected size (the previous checkpoint's, or the engine's weights and optimizer
    state summed over ranks), or when the write runs out of space; nothing half-written stays.
    """
    root = Path(output_dir) / CHECKPOINTS_DIR
    final = root / checkpoint_name(step)
    temporary = root / (TEMP_PREFIX + checkpoint_name(step))
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
    _barrier()
    previous = latest_checkpoint(output_dir)
    expected = max(
        _sum_over_ranks(engine_state_bytes(engine, exclude_frozen, rank)),
        directory_bytes(previous) if previous is not None else 0,
    )
    try:
        with space_checked_write(root, temporary, with_margin(expected), f"checkpoint {final.name}"):
            options = {"exclude_frozen_parameters": True} if exclude_frozen else {}
            engine.save_checkpoint(str(temporary), tag=ENGINE_TAG, save_latest=False, **options)
            torch.save(capture_rng_state(), temporary / f"rng_state_{rank}.pt")
            _barrier()
            if rank == 0:
                state = json.dumps({**trainer_state, "step": step}, indent=2) + "\n"
                (temporary / STATE_NAME).write_text(state)
                write_head_config(engine, temporary, step, trainer_state)
                write_manifest(temporary)
        if rank == 0:
            if final.exists():  # re-saving a step (e.g. the final save right after a periodic one)
                shutil.rmtree(final)
            os.replace(temporary, final)
            for old in list_checkpoints(output_dir)[: -max(1, keep)]:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    _barrier()
    return final


def load_checkpoint(
    engine,
    checkpoint: str | Path,
    rank: int = 0,
    exclude_frozen: bool = False,
    engine_root: str | Path | None = None,
) -> dict[str, Any]:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG; return trainer state.
    ``exclude_frozen``: the checkpoint was saved without frozen parameters (they stay as loaded).
    ``engine_root``: read the engine state from ``engine_root/engine`` instead (a universal
    conversion, ``train/elastic.py``). A rank of a run with more processes than wrote the
    checkpoint takes the RNG state of rank ``rank % writers`` (``rng_state_path``).
    A file whose pickle needs more than tensors and DeepSpeed's own classes raises
    UnsafeCheckpointError naming it, before anything of it is unpickled."""
    checkpoint = Path(checkpoint)
    state_path = checkpoint / STATE_NAME
    if not state_path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no {STATE_NAME})")
    # DeepSpeed unpickles its own files: check each against the allow-list first (naming the file
    # it refuses), and keep every load weights-only while DeepSpeed reads them.
    allowed = deepspeed_state_classes()
    root = checkpoint if engine_root is None else Path(engine_root)
    check_loadable(sorted((root / ENGINE_TAG).rglob("*.pt")), allowed)
    with weights_only_loads(allowed, root / ENGINE_TAG):
        load_path, _ = engine.load_checkpoint(
            str(root),
            tag=ENGINE_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not exclude_frozen,
        )
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no engine state under {root / ENGINE_TAG}")
    state = json.loads(state_path.read_text())
    rng_path = rng_state_path(checkpoint, rank, written_world_size(state))
    if not rng_path.is_file():
        raise FileNotFoundError(f"{rng_path} is missing: the checkpoint is incomplete")
    restore_rng_state(load_restricted(rng_path, legacy_rng_globals()))
    return state


def rng_state_path(checkpoint: Path, rank: int, writers: int) -> Path:
    """The RNG state file rank ``rank`` restores from a checkpoint ``writers`` processes wrote:
    its own, or under more processes than wrote it, rank ``rank % writers``'s (the training draws
    are functions of the seed and the row, ``draftheads.train.draws``, not of this state)."""
    return checkpoint / f"rng_state_{rank % max(1, writers)}.pt"
