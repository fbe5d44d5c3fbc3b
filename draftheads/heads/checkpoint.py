"""A head inside a training checkpoint (``<run>/checkpoints/step-N``), readable like a head directory.

``draftheads train`` writes the head's directory (``<run>/head``) only when the run ends; after a
crash the head exists only in its checkpoints. Each checkpoint carries the head's ``config.json``
(as ``save_pretrained`` writes it, less the weights' hash) next to DeepSpeed's engine state, and
the head's weights are the ``head.`` entries of the engine's module state. So ``load_head``, and
with it ``export``, ``generate --heads`` and ``train.init_head``, read a checkpoint directory as
they read a head directory.

Under ZeRO-3 the module state holds empty partitions (the weights live, flattened, in each rank's
optimizer state); such a checkpoint is refused with the way out: resume it for zero more steps,
which writes ``<run>/head``.

Every checkpoint lists the size and sha256 of its files in ``manifest.json`` (written last). Resume
checks all of them; a checkpoint read as a head checks the files the head comes from (its
config.json and the module state) the same way, so damaged weights are refused, naming the file,
instead of being exported or decoded with. Checkpoints written before manifests load unverified.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from draftheads.heads.base import CONFIG_NAME, HeadFormatError, inside_head
from draftheads.storage import file_sha256

# The layout of a run's checkpoints (``draftheads.train.checkpoint`` writes it).
CHECKPOINTS_DIR = "checkpoints"  # under the run's output directory, one step-N directory each
TRAINER_STATE_NAME = "trainer_state.json"  # step, data position, run config
ENGINE_DIR = "engine"  # DeepSpeed's engine state (its ``tag``)
MODULE_STATE_NAME = "mp_rank_00_model_states.pt"  # the wrapped module's full state (ZeRO 0-2)
MANIFEST_NAME = "manifest.json"  # size and sha256 of every other file of the checkpoint
# The module DeepSpeed wraps is the training recipe, which holds the head as its ``head``.
HEAD_PREFIX = "head."


class CheckpointHeadError(HeadFormatError):
    """A training checkpoint whose head cannot be read (see ``checkpoint_head_state``)."""


class CorruptCheckpointError(CheckpointHeadError):
    """A checkpoint whose files do not match its manifest (or cannot be read)."""


def write_manifest(directory: Path) -> None:
    """Record the size and sha256 of every file under ``directory`` in its ``manifest.json``."""
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    (directory / MANIFEST_NAME).write_text(json.dumps({"files": files}, indent=1) + "\n")


def verify_checkpoint(checkpoint: str | Path, names: Iterable[str] | None = None) -> bool:
    """Check the files of ``checkpoint`` against its manifest (``names``: only these, relative
    paths; default every file it lists): True when they match, False for a checkpoint written
    before manifests existed (it cannot be verified); raise CorruptCheckpointError naming the first
    file that is missing, unlisted, has another size or another sha256, or a manifest that cannot
    be read."""
    checkpoint = Path(checkpoint)
    manifest_path = checkpoint / MANIFEST_NAME
    if not manifest_path.is_file():
        return False
    try:
        files = json.loads(manifest_path.read_text())["files"]
        expected = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptCheckpointError(f"{manifest_path} cannot be read: {err}") from err
    for name in expected if names is None else names:
        path = checkpoint / name
        if name not in expected:
            raise CorruptCheckpointError(f"{path} is not listed in {manifest_path}")
        size, digest = expected[name]
        if not path.is_file():
            raise CorruptCheckpointError(f"{path} is missing")
        if path.stat().st_size != size:
            raise CorruptCheckpointError(f"{path} has {path.stat().st_size} bytes, the manifest says {size}")
        if file_sha256(path) != digest:
            raise CorruptCheckpointError(f"{path} does not match its sha256 in {MANIFEST_NAME}")
    return True


def is_training_checkpoint(directory: Path) -> bool:
    """Is ``directory`` a training checkpoint (trainer state + engine state)?"""
    return (directory / TRAINER_STATE_NAME).is_file() and (directory / ENGINE_DIR).is_dir()


def _resume_hint(checkpoint: Path) -> str:
    return (
        f"to get its head, resume the run for zero more steps (train.resume=true, train.max_steps set to "
        f"its step, {checkpoint.name.removeprefix('step-').lstrip('0') or '0'}): that writes "
        f"{checkpoint.parent.parent / 'head'}"
    )


def checkpoint_head_state(
    checkpoint: Path, map_location: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The head's tensors in the engine state of ``checkpoint`` (read with ``weights_only=True``:
    tensors and plain values only), once its config.json and module state match the checkpoint's
    manifest. Raises CorruptCheckpointError naming a file that does not, CheckpointHeadError when
    the checkpoint keeps no full module state (ZeRO-3) or holds no head entries."""
    path = inside_head(checkpoint, checkpoint / ENGINE_DIR / MODULE_STATE_NAME)
    if not path.is_file():
        raise CheckpointHeadError(
            f"{checkpoint}: no {ENGINE_DIR}/{MODULE_STATE_NAME} (a ZeRO-3 checkpoint keeps the weights in "
            f"per-rank partitions); {_resume_hint(checkpoint)}"
        )
    verify_checkpoint(checkpoint, (CONFIG_NAME, f"{ENGINE_DIR}/{MODULE_STATE_NAME}"))
    try:
        saved = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch's errors name no file
        raise CheckpointHeadError(f"{path}: not a readable checkpoint ({str(err).splitlines()[0]})") from err
    module = saved.get("module") if isinstance(saved, dict) else None
    state = {
        name.removeprefix(HEAD_PREFIX): tensor
        for name, tensor in (module or {}).items()
        if name.startswith(HEAD_PREFIX) and isinstance(tensor, torch.Tensor)
    }
    if not state:
        raise CheckpointHeadError(f"{path}: holds no '{HEAD_PREFIX}' weights; {_resume_hint(checkpoint)}")
    return state


def missing_config_hint(checkpoint: Path) -> str:
    """Why a training checkpoint without config.json (written before checkpoints carried one)
    cannot be read as a head, and what to do instead."""
    return (
        f"{checkpoint} is a training checkpoint written before checkpoints carried the head's "
        f"config.json; {_resume_hint(checkpoint)}"
    )


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest training checkpoint under a run's output directory, if any."""
    found = sorted(
        path for path in (run_dir / CHECKPOINTS_DIR).glob("step-*") if is_training_checkpoint(path)
    )
    return found[-1] if found else None
