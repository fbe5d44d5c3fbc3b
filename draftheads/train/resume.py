"""Which settings a resumed run may change, and the record of the data a head was trained on.

A checkpoint holds one head configuration's weights and optimizer state, and a data position that
means something only for one data source and batch layout. So a resume compares the run config
that wrote the checkpoint with the new one: settings that only steer how long the run goes on and
what it reports may change; changed data or batch size needs an explicit opt-in (then the stream
starts over on the new data, and the data history records it); anything else is refused, naming
each field as ``old -> new``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from draftheads.settings import ConfigError

# Settings a resumed run may change freely: run length, logging, evaluation and checkpoint
# cadence, where things go. A key names a field or a whole section.
FREE_ON_RESUME = (
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.report_to",
    "train.wandb_project",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_checkpoints",
    "train.resume",
    "train.output_dir",
    "train.base_throughput_batches",
    "train.autocast",  # fp32 weights and optimizer state either way: a resume may turn it on or off
    "train.decode_eval_prompts",
    "train.decode_eval_source",
    "train.decode_eval_skip",
    "train.decode_eval_max_new_tokens",
    "train.decode_eval_max_prompt_tokens",
    "train.decode_eval_depth",
    "data.cache_dir",
    "distill",  # read by `draftheads distill`, not by training
)
# Settings that choose which examples the head sees and in which batches: changed only with
# ``allow_changed_data`` (``draftheads train --allow-changed-data``). (The number of processes is
# checked on its own: a ZeRO checkpoint's optimizer partitions are per rank.)
DATA_ON_RESUME = (
    "data",
    "train.micro_batch_size",
    "train.gradient_accumulation_steps",
    "train.group_by_length",
    "train.seed",
)


@dataclass(frozen=True)
class Change:
    key: str  # dotted, e.g. head.num_heads
    old: Any
    new: Any

    def describe(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == pattern or key.startswith(pattern + ".") for pattern in patterns)


def run_record(config: dict) -> dict[str, Any]:
    """A run config (``settings.to_dict``) as plain JSON values (tuples become lists): the form a
    checkpoint stores and ``changed_settings`` compares."""
    return json.loads(json.dumps(config, default=str))


def changed_settings(old: dict, new: dict) -> list[Change]:
    """Every setting (dotted key) recorded in both ``run_record``s whose value differs, except
    those in FREE_ON_RESUME. (A key on one side only is a setting another draftheads version did
    not have, or another head kind's: ``head.kind`` itself then differs.)"""
    old_flat, new_flat = _flatten(old), _flatten(new)
    return [
        Change(key, old_flat[key], new_flat[key])
        for key in sorted(old_flat.keys() & new_flat.keys())
        if old_flat[key] != new_flat[key] and not _matches(key, FREE_ON_RESUME)
    ]


def unrecorded_settings(old: dict, new: dict) -> list[str]:
    """Settings of ``new`` that ``old`` does not record (it was written by an older draftheads),
    so a resume cannot check them."""
    old_flat = _flatten(old)
    return sorted(key for key in _flatten(new) if key not in old_flat and not _matches(key, FREE_ON_RESUME))


def check_resume(old: dict, new: dict, allow_changed_data: bool, where: str) -> list[Change]:
    """Refuse resuming the run recorded as ``old`` with the settings ``new`` (``run_record``s)
    unless only free or, with ``allow_changed_data``, data settings changed; return the data
    changes (the caller records them). ``where`` names the checkpoint in the message."""
    changes = changed_settings(old, new)
    data = [change for change in changes if _matches(change.key, DATA_ON_RESUME)]
    fixed = [change for change in changes if not _matches(change.key, DATA_ON_RESUME)]
    if fixed:
        raise ConfigError(
            f"train.resume: {where} was written with other settings, which a resumed run cannot "
            "change:\n  "
            + "\n  ".join(change.describe() for change in changes)
            + "\nput them back, or train into another train.output_dir "
            "(train.init_head=<a finished run's head/> starts from its weights)"
        )
    if data and not allow_changed_data:
        raise ConfigError(
            f"train.resume: {where} was trained on other data or batches:\n  "
            + "\n  ".join(change.describe() for change in data)
            + "\nput them back, or pass --allow-changed-data (allow_changed_data=True) to go on "
            "with these; the head's training record then lists every data source it saw"
        )
    return data


def data_segment(record: dict, from_step: int, description: str) -> dict[str, Any]:
    """One entry of a run's data history: from which optimiser step the head trained on what."""
    flat = _flatten(record)
    settings = {
        key: value
        for key, value in flat.items()
        if _matches(key, DATA_ON_RESUME) and not _matches(key, FREE_ON_RESUME)
    }
    return {"from_step": from_step, "source": description, "settings": settings}
