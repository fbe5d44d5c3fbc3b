"""Write the training record of a finished run (docs/results/2026-11-22-training-records/*.json).

A record holds the run's training summary (from its ``head/config.json``) and its held-out
evaluations (from ``metrics.jsonl``), each with the tokens trained on when it ran. A run that
continued a saved head (``train.init_head``) also records where it started: the saved head scored
on the run's own held-out split and decode prompts before the first step, and the tokens that
head had trained on, so that scripts/fit_scaling.py can place its points on one token axis.
That starting score comes from a zero-step run on the same config (older records: one step at
learning rate 1e-12; the record says which):

    draftheads train --config CONFIG train.init_head=HEAD train.output_dir=START_DIR \\
        train.epochs=null train.max_steps=0

    python scripts/training_record.py RUN_DIR OUT.json --config CONFIG [--overrides K=V ...] \\
        [--start-dir START_DIR --start-record START_RECORD.json --init-head HEAD] \\
        --machine "$(lscpu | grep Flags)"

START_RECORD.json is the record of the run that trained HEAD (its ``summary.tokens``, plus its own
``start.tokens`` where that run continued a head too, is the starting token count).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftheads.train.reporting import METRICS_NAME, read_metrics


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: not found") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not JSON ({error})") from None


def field(record: dict, path: Path, *keys: str):
    value = record
    for depth, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            raise SystemExit(f"{path}: no field {'.'.join(keys[: depth + 1])}")
        value = value[key]
    return value


def evaluations(run_dir: Path) -> list[dict]:
    """Each held-out evaluation in the run's metrics.jsonl, with the tokens trained on when it ran."""
    if not (run_dir / METRICS_NAME).is_file():
        raise SystemExit(f"{run_dir / METRICS_NAME}: not found")
    try:
        entries = read_metrics(run_dir)
    except json.JSONDecodeError as error:
        raise SystemExit(f"{run_dir / METRICS_NAME}: not JSON Lines ({error})") from None
    tokens_at = {entry["step"]: entry["tokens"] for entry in entries if "tokens" in entry}
    return [
        {"step": entry["step"], "tokens": tokens_at.get(entry["step"]), **entry["eval"]}
        for entry in entries
        if "eval" in entry
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", required=True)
    parser.add_argument("--overrides", nargs="*", default=[], help="the run's command-line settings")
    parser.add_argument("--start-dir", type=Path, help="a continued run: its one-step scoring run")
    parser.add_argument("--start-record", type=Path, help="a continued run: the record of its head")
    parser.add_argument("--init-head", help="a continued run: its train.init_head")
    parser.add_argument("--machine", required=True, help="the CPU it ran on (lscpu flags)")
    parser.add_argument("--note", help="anything a reader of the numbers should know")
    args = parser.parse_args()
    continued = (args.start_dir, args.start_record, args.init_head)
    if any(continued) and not all(continued):
        parser.error("--start-dir, --start-record and --init-head go together")

    head_config = args.run_dir / "head" / "config.json"
    record = {
        "run": args.run_dir.name,
        "config": args.config,
        "overrides": args.overrides + ([f"train.init_head={args.init_head}"] if args.init_head else []),
    }
    if args.start_dir:
        start_config = args.start_dir / "head" / "config.json"
        start = read_json(start_config)
        scored = "no step (train.max_steps=0)"
        if field(start, start_config, "training", "steps"):
            scored = (
                "one step at learning rate 1e-12 "
                "(train.max_steps=1 train.learning_rate=1e-12 train.warmup_steps=0)"
            )
        # the tokens HEAD had trained on: its own run's, plus its start's if that run continued one
        start_record = read_json(args.start_record)
        start_tokens = field(start_record, args.start_record, "summary", "tokens")
        if "start" in start_record:
            start_tokens += field(start_record, args.start_record, "start", "tokens")
        record["start"] = {
            "head": args.init_head,
            "tokens": start_tokens,
            **field(start, start_config, "training", "eval"),
            "how": f"the starting head scored on this run's held-out split and decode prompts: {scored}",
        }
    summary = field(read_json(head_config), head_config, "training")
    record |= {"summary": summary, "evaluations": evaluations(args.run_dir)}
    record["machine"] = args.machine
    if args.note:
        record["note"] = args.note
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: {len(record['evaluations'])} evaluations, {summary['tokens']:,} tokens")


if __name__ == "__main__":
    main()
