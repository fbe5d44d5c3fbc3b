"""Replay recorded big-tree steps (record_big_trees.py): for each rule that picks a subtree of the
proposals, the tokens a step it would have emitted, from what the verifier actually accepted (a
subtree closed under parents emits 1 + the accepted nodes it holds: the accepted path is a chain
from the root). Every rule sees the same steps.

Rules, for trees of n nodes (root included) from the proposals up to depth D:
- raw: EAGLE-2's, the n - 1 best cumulative draft probabilities;
- calibrated: the path's product of per-depth acceptance rates, each node's rate read from a table
  fitted on FIT (acceptance given the parent accepted, by depth and by the node's own draft
  probability in eighths, shrunk towards the bin's probability by two pseudo-nodes).

    python <this file> FIT.jsonl EVAL.jsonl
"""

import json
import sys
from collections import defaultdict

BINS = 8
FIT_DEPTH = 6


def load(path: str) -> list[dict]:
    steps = []
    with open(path) as f:
        records = [json.loads(line) for line in f]
    for record in records:
        for step in record["steps"]:
            parents, scores = step["parents"], step["scores"]
            depth, own = [0] * len(scores), [1.0] * len(scores)
            for node in range(1, len(scores)):
                depth[node] = depth[parents[node]] + 1
                above = scores[parents[node]]
                own[node] = scores[node] / above if above > 0 else 0.0
            accepted = set(step["accepted"])
            entry = {"parents": parents, "scores": scores, "depth": depth, "own": own}
            steps.append(entry | {"accepted": accepted})
    return steps


def key(step: dict, node: int) -> tuple[int, int]:
    return min(step["depth"][node], FIT_DEPTH), min(BINS - 1, int(step["own"][node] * BINS))


def with_accepted_parent(steps: list[dict]):
    for step in steps:
        for node in range(1, len(step["scores"])):
            if step["parents"][node] in step["accepted"]:
                yield step, node


def fit(steps: list[dict]) -> dict[tuple[int, int], float]:
    counts = defaultdict(lambda: [0, 0])
    for step, node in with_accepted_parent(steps):
        entry = counts[key(step, node)]
        entry[0] += 1
        entry[1] += node in step["accepted"]
    return {k: (accepted + 2 * (k[1] + 0.5) / BINS) / (seen + 2) for k, (seen, accepted) in counts.items()}


def calibrated(step: dict, table: dict) -> list[float]:
    scores = [1.0] * len(step["scores"])
    for node in range(1, len(scores)):
        scores[node] = scores[step["parents"][node]] * table.get(key(step, node), step["own"][node])
    return scores


def emitted(step: dict, scores: list[float], depth: int, nodes: int) -> int:
    candidates = [n for n in range(1, len(scores)) if step["depth"][n] <= depth]
    kept = set(sorted(candidates, key=lambda n: -scores[n])[: nodes - 1])  # stable: parents first on ties
    for node in list(kept):  # ties could drop an ancestor: put it back
        parent = step["parents"][node]
        while parent > 0 and parent not in kept:
            kept.add(parent)
            parent = step["parents"][parent]
    return 1 + len(kept & step["accepted"])


def main(fit_path: str, eval_path: str) -> None:
    fit_steps, eval_steps = load(fit_path), load(eval_path)
    table = fit(fit_steps)
    print("acceptance given the parent accepted, by depth: mean draft probability -> accepted share (nodes)")
    for name, steps in (("fit", fit_steps), ("eval", eval_steps)):
        by_depth = defaultdict(lambda: [0, 0.0, 0])
        for step, node in with_accepted_parent(steps):
            entry = by_depth[step["depth"][node]]
            entry[0] += 1
            entry[1] += step["own"][node]
            entry[2] += node in step["accepted"]
        cells = [f"{d}: {p / n:.3f} -> {a / n:.3f} ({n})" for d, (n, p, a) in sorted(by_depth.items())]
        print(f"  {name} ({len(steps)} steps): " + "; ".join(cells))
    sizes = (6, 8, 10, 12, 14, 16, 20)
    print("tokens a step on EVAL, raw / calibrated, for n nodes from the proposals up to depth D")
    print("| D | " + " | ".join(f"n = {n}" for n in sizes) + " |")
    print("|---:|" + "---|" * len(sizes))
    calibrated_scores = [calibrated(step, table) for step in eval_steps]
    for depth in (3, 4, 5, 6):
        cells = []
        for nodes in sizes:
            raw = sum(emitted(s, s["scores"], depth, nodes) for s in eval_steps) / len(eval_steps)
            cal = sum(emitted(s, c, depth, nodes) for s, c in zip(eval_steps, calibrated_scores))
            cal /= len(eval_steps)
            cells.append(f"{raw:.3f} / {cal:.3f}")
        print(f"| {depth} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
