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
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftheads.heads.base import HeadFormatError

# The layout of a run's checkpoints (``draftheads.train.checkpoint`` writes it).
CHECKPOINTS_DIR = "checkpoints"  # under the run's output directory, one step-N directory each
TRAINER_STATE_NAME = "trainer_state.json"  # step, data position, run config
ENGINE_DIR = "engine"  # DeepSpeed's engine state (its ``tag``)
MODULE_STATE_NAME = "mp_rank_00_model_states.pt"  # the wrapped module's full state (ZeRO 0-2)
# The module DeepSpeed wraps is the training recipe, which holds the head as its ``head``.
HEAD_PREFIX = "head."


class CheckpointHeadError(HeadFormatError):
    """A training checkpoint whose head cannot be read (see ``checkpoint_head_state``)."""


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
    tensors and plain values only). Raises CheckpointHeadError when the checkpoint keeps no full
    module state (ZeRO-3) or holds no head entries."""
    path = checkpoint / ENGINE_DIR / MODULE_STATE_NAME
    if not path.is_file():
        raise CheckpointHeadError(
            f"{checkpoint}: no {ENGINE_DIR}/{MODULE_STATE_NAME} (a ZeRO-3 checkpoint keeps the weights in "
            f"per-rank partitions); {_resume_hint(checkpoint)}"
        )
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
