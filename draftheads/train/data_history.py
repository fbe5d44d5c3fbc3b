"""A run's data history: every data source its head trained on, in order, each from the step it
started at; planned at setup, when a resume may go on with other data."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from draftheads.config import RunConfig
from draftheads.settings import to_dict
from draftheads.train import checkpoint, elastic
from draftheads.train.resume import check_resume, data_segment, run_record, unrecorded_settings


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
