"""What the traces of step_trace.py say about the WIDTH-row steps the gate measures (drafting steps
not catching the head up, and plain steps): each kind's rate (tokens emitted over seconds), the
scatter of single steps' rates (standard deviation over mean), and for drafting the lag-1 and
lag-10 autocorrelation of the tokens a step counts. A drafting step counts the tokens it was expected
to emit (the gate scales them by what recent steps emitted over that), a plain step its rows.

Run from the repository root:
    .venv/bin/python <this file> WIDTH
"""

import gzip
import json
import statistics
import sys
from pathlib import Path


def autocorrelation(values: list[float], lag: int) -> float:
    mean = statistics.mean(values)
    top = sum((values[i] - mean) * (values[i + lag] - mean) for i in range(len(values) - lag))
    return top / sum((v - mean) ** 2 for v in values)


def main(width: int) -> None:
    here = Path(__file__).parent
    for mode in ("draft", "plain"):
        with gzip.open(here / f"trace-{mode}-{width}.json.gz", "rt") as file:
            steps = [s for s in json.load(file) if s["rows"] == width and not s["catching_up"]]
        emitted = [s["emitted"] if s["drafted"] else s["tokens"] for s in steps]
        rates = [e / s["seconds"] for e, s in zip(emitted, steps)]
        counted = [s["tokens"] / s["seconds"] for s in steps]  # what the gate averages
        rate = sum(emitted) / sum(s["seconds"] for s in steps)
        print(
            f"{mode}, {width} rows: {len(steps)} steps, {rate:.1f} "
            f"tokens/s, {1000 * statistics.mean(s['seconds'] for s in steps):.1f} ms a step, "
            f"single steps' rates scattered by {statistics.stdev(counted) / statistics.mean(counted):.0%} "
            f"(counting expected tokens, as the gate does; emitted: "
            f"{statistics.stdev(rates) / statistics.mean(rates):.0%})"
        )
        if mode == "draft":
            counted = [s["tokens"] for s in steps]
            print(
                f"  tokens a step {statistics.mean(counted):.2f} (emitted {statistics.mean(emitted):.2f}); "
                f"autocorrelation lag 1 {autocorrelation(counted, 1):.2f}, "
                f"lag 10 {autocorrelation(counted, 10):.2f}"
            )


if __name__ == "__main__":
    main(int(sys.argv[1]))
