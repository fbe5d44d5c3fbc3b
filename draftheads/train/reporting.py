"""Where training metrics go: ``metrics.jsonl`` in the output dir, optionally wandb, and a PNG of
the loss / accuracy curves at the end; progress lines go to the console. Only rank 0 reports."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from draftheads.storage import write_atomically, write_text_atomically

METRICS_NAME = "metrics.jsonl"
CURVES_NAME = "curves.png"


def finite_or_null(value: Any) -> Any:
    """``value`` with every inf / nan float, however deeply nested, as None: JSON has no such
    numbers (``json.dumps`` would write ``NaN``, which strict readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def log_rank0(rank: int, message: str) -> None:
    """Write ``message`` as one progress line on rank 0 (through tqdm: it stays above the bar)."""
    if rank == 0:
        from tqdm import tqdm

        tqdm.write(f"[draftheads] {message}")


class Reporter:
    """Append metric records (dicts with a ``step``) to JSONL (a non-finite number as null) and,
    if asked, to wandb.

    On resume, records past the resumed step (written by the interrupted run after its last
    checkpoint) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(
        self,
        output_dir: str | Path,
        report_to: str = "none",
        project: str = "draftheads",
        config: dict | None = None,
        resume_step: int | None = None,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / METRICS_NAME
        self.wandb_run = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            kept = [
                line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step
            ]
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))
        elif self.path.is_file():
            self.path.unlink()
        if report_to == "wandb":
            import wandb  # lazy: only runs that report to wandb need it (WANDB_MODE=offline works offline)

            self.wandb_run = wandb.init(
                project=project,
                name=Path(output_dir).name,
                dir=str(output_dir),
                config=config,
                resume="allow",
            )

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # O_NOFOLLOW: a link put in the file's place is refused (ELOOP), never written through.
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "a") as handle:
            handle.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(_flatten(record), step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"eval": {"top1": [a, b]}}`` -> ``{"eval/top1/0": a, "eval/top1/1": b}`` for wandb."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            flat.update({f"{name}/{index}": item for index, item in enumerate(value)})
        elif key != "step":
            flat[name] = value
    return flat


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / METRICS_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def plot_curves(output_dir: str | Path) -> Path | None:
    """Training loss and held-out top-1 per draft step against the optimiser step, as a PNG; with
    the decode evaluation, its top-1 acceptance per depth on the same axes."""
    records = read_metrics(output_dir)
    train_records = [r for r in records if "loss" in r]
    eval_records = [r for r in records if "eval" in r]
    # The decode evaluation (train.decode_eval_prompts), where the run made one.
    decode_records = [r for r in eval_records if "decode" in r["eval"]]
    if not train_records and not eval_records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot([r["step"] for r in train_records], [r["loss"] for r in train_records], label="train")
    if eval_records:
        loss_axis.plot(
            [r["step"] for r in eval_records],
            [r["eval"]["loss"] for r in eval_records],
            "o-",
            label="held-out",
        )
        colors = {}
        for step_index in range(len(eval_records[-1]["eval"]["top1"])):
            (line,) = accuracy_axis.plot(
                [r["step"] for r in eval_records],
                [r["eval"]["top1"][step_index] for r in eval_records],
                "o-",
                label=f"draft step {step_index + 1}",
            )
            colors[step_index] = line.get_color()
        depths = len(decode_records[-1]["eval"]["decode"]["top1"]) if decode_records else 0
        for depth_index in range(depths):  # dashed, depth d in draft step d's color
            accuracy_axis.plot(
                [r["step"] for r in decode_records],
                [r["eval"]["decode"]["top1"][depth_index] for r in decode_records],
                "s--",
                color=colors.get(depth_index),
                label=f"decode depth {depth_index + 1}",
            )
        accuracy_axis.legend(fontsize="small")
    loss_axis.set(xlabel="optimizer step", ylabel="loss", title="loss")
    loss_axis.legend()
    accuracy_axis.set(
        xlabel="optimizer step",
        ylabel="top-1 accuracy",
        title="top-1 per draft step: held-out (solid), decode (dashed)"
        if decode_records
        else "held-out top-1 per draft step",
    )
    figure.tight_layout()
    path = Path(output_dir) / CURVES_NAME
    write_atomically(path, lambda temporary: figure.savefig(temporary, dpi=100))
    plt.close(figure)
    return path
