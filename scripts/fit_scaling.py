"""How held-out top-1 grows with training tokens, fitted on the measured EAGLE-3 curves
(docs/log.md, 2026-11-25: where the curve flattens).

Each training record (docs/results/2026-11-22-training-records/*.json) gives held-out top-1 at draft
step 1 and the chain acceptance at every evaluation. The x axis is the tokens the head has trained
on when it is scored: ``step * tokens / steps`` of the run, plus ``start.tokens`` for a run that continued a
saved head (``train.init_head``), whose ``start`` entry is that head scored on the run's own
held-out split before the first step. Each run is fitted on its own points (runs differ in
held-out text, so their levels are not comparable across runs, only their slopes) with

    top1 = a + b * ln(tokens)

by least squares: ``b * ln 2`` is the gain per doubling of tokens, and the fit answers what the
next 10x of tokens would buy if the curve keeps its log-linear shape, and how many tokens would
reach a target (0.65 by default). A saturating law (top1 = c - d * tokens^-alpha) has three
parameters: fitted on 4-6 points of one run it is not identified, so it is not reported.

    python scripts/fit_scaling.py OUT_DIR RECORD.json [RECORD.json ...] [--target 0.65]

Writes OUT_DIR/fit.json and OUT_DIR/top1_vs_tokens.png, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Point:
    tokens: float
    top1: float
    chain: float


@dataclass
class Fit:
    run: str
    points: list[Point]
    intercept: float  # a
    slope: float  # b, per unit of ln(tokens)
    per_doubling: float
    r_squared: float
    last_tokens: float
    last_top1: float
    at_10x: float  # the fitted top1 at 10x the last point's tokens
    tokens_for_target: float | None  # where the fit reaches the target (None: it never rises)


def read_points(record: dict, source: str) -> list[Point]:
    try:
        summary = record["summary"]
        per_step = summary["tokens"] / summary["steps"]
        start = record.get("start")
        offset = start["tokens"] if start else 0
        points = [Point(offset, start["top1"][0], start["chain_acceptance"])] if start else []
        for evaluation in record["evaluations"]:
            tokens = offset + (evaluation.get("tokens") or evaluation["step"] * per_step)
            points.append(Point(tokens, evaluation["top1"][0], evaluation["chain_acceptance"]))
    except (KeyError, TypeError, ZeroDivisionError) as error:
        raise SystemExit(
            f"{source}: not a training record with summary.tokens/steps and evaluations ({error!r})"
        ) from None
    if len(points) < 2 or any(p.tokens <= 0 for p in points):
        raise SystemExit(f"{source}: needs at least two evaluations after some training tokens")
    return points


def fit_log_linear(run: str, points: list[Point], target: float) -> Fit:
    xs = [math.log(p.tokens) for p in points]
    ys = [p.top1 for p in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    total = sum((y - mean_y) ** 2 for y in ys)
    last = points[-1]
    return Fit(
        run=run,
        points=points,
        intercept=intercept,
        slope=slope,
        per_doubling=slope * math.log(2),
        r_squared=1 - residual / total if total > 0 else 1.0,
        last_tokens=last.tokens,
        last_top1=last.top1,
        at_10x=intercept + slope * math.log(10 * last.tokens),
        tokens_for_target=math.exp((target - intercept) / slope) if slope > 0 else None,
    )


def plot(fits: list[Fit], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for fit in fits:
        xs = [p.tokens for p in fit.points]
        line = axis.plot(xs, [p.top1 for p in fit.points], "o", label=f"{fit.run} (measured)")[0]
        right = 10 * fit.last_tokens
        grid = [xs[0] * (right / xs[0]) ** (i / 50) for i in range(51)]
        axis.plot(
            grid,
            [fit.intercept + fit.slope * math.log(x) for x in grid],
            "--",
            color=line.get_color(),
            label=f"{fit.run}: {fit.per_doubling:+.3f} per doubling",
        )
    axis.axhline(target, color="grey", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xlabel("training tokens seen by the head")
    axis.set_ylabel("held-out top-1 at draft step 1")
    axis.set_title("EAGLE-3 on SmolLM2-135M: measured points and log-linear fits to 10x")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("records", nargs="+", type=Path)
    parser.add_argument("--target", type=float, default=0.65)
    args = parser.parse_args()
    fits = []
    for path in args.records:
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"{path}: cannot read a training record ({error})") from None
        fits.append(fit_log_linear(record.get("run", path.stem), read_points(record, str(path)), args.target))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"target": args.target, "model": "top1 = a + b ln(tokens)", "fits": [asdict(f) for f in fits]}
    (args.out_dir / "fit.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(fits, args.target, args.out_dir / "top1_vs_tokens.png")
    header = "| run | points | last: tokens, top-1 | per doubling | R^2 | at 10x tokens | tokens for"
    print(f"{header} {args.target} |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for f in fits:
        reach = f"{f.tokens_for_target / 1e6:,.0f}M" if f.tokens_for_target else "never"
        print(
            f"| {f.run} | {len(f.points)} | {f.last_tokens / 1e6:.2f}M, {f.last_top1:.3f} | "
            f"{f.per_doubling:+.3f} | {f.r_squared:.2f} | {f.at_10x:.3f} | {reach} |"
        )


if __name__ == "__main__":
    main()
