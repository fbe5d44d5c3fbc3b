"""What tuning found, for people: a few terminal lines and a chart."""

from __future__ import annotations

import warnings
from pathlib import Path

from draftheads.optional import available
from draftheads.storage import write_atomically


def plot_tuning(record: dict, path: Path) -> list[Path]:
    """Acceptance by depth and rank, the verify cost curve, expected speedup by tree size; no chart
    (and a warning) where matplotlib is not installed."""
    if not available("matplotlib"):
        warnings.warn("matplotlib is not installed: no tuning chart (pip install 'draftheads[plots]')")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    probabilities = record["acceptance"]["probabilities"]
    depths = range(1, len(probabilities) + 1)
    for rank in range(min(3, len(probabilities[0]) if probabilities else 0)):
        axes[0].plot(depths, [row[rank] for row in probabilities], marker="o", label=f"rank {rank}")
    axes[0].plot(depths, [sum(row) for row in probabilities], marker="s", linestyle="--", label="top-k")
    axes[0].set(xlabel="depth", ylabel="P(accepted | parent accepted)", ylim=(0, 1), title="acceptance")
    axes[0].legend(fontsize=8)
    cost = record["verify_cost"]
    axes[1].plot(
        cost["sizes"],
        [s / cost["fitted_seconds"][0] for s in cost["seconds"]],
        "o",
        label="measured (median)",
    )
    axes[1].plot(cost["sizes"], cost["relative"], label="isotonic fit")
    axes[1].legend(fontsize=8)
    axes[1].set(
        xlabel="tree tokens N", ylabel="cost(N) / cost(1)", title=f"verify cost ({record['setting']})"
    )
    best_by_size: dict[int, float] = {}
    for candidate in record["candidates"]:
        best_by_size[candidate["nodes"]] = max(
            best_by_size.get(candidate["nodes"], 0.0), candidate["expected_speedup"]
        )
    sizes = sorted(best_by_size)
    axes[2].plot(sizes, [best_by_size[n] for n in sizes], marker=".")
    axes[2].axvline(record["chosen"]["nodes"], color="grey", linestyle=":")
    axes[2].set(
        xlabel="tree tokens N", ylabel="expected speedup", title=f"chosen: {record['chosen']['tree']['name']}"
    )
    fig.tight_layout()
    write_atomically(path, lambda temporary: fig.savefig(temporary, dpi=110))
    plt.close(fig)
    return [path]


def describe(record: dict) -> str:
    """A few lines for the terminal: acceptance, cost, the choice."""
    acceptance = record["acceptance"]
    top1 = " ".join(f"{row[0]:.2f}" for row in acceptance["probabilities"])
    topk = " ".join(f"{sum(row):.2f}" for row in acceptance["probabilities"])
    cost = record["verify_cost"]
    ceiling = cost["ceiling"]
    curve = ", ".join(
        f"{n}:{c:.2f}" for n, c in zip(cost["sizes"], cost["relative"]) if n in (1, 4, 8, 16, 32, 64)
    )
    chosen = record["chosen"]
    return (
        f"acceptance over {acceptance['counts'][0] if acceptance['counts'] else 0} positions, "
        f"P(accept | parent) by depth: top-1 {top1}; top-{len(acceptance['probabilities'][0])} {topk}\n"
        f"verify cost relative to 1 token ({record['setting']}, "
        f"one token {1000 * cost['seconds'][0]:.1f} ms): {curve}\n"
        f"ceiling on this machine: {ceiling['speedup']:.2f}x (a head whose every draft is accepted, "
        f"drafting for free, with a {ceiling['tokens']}-token chain); at tau 2 / 3 / 4 at most "
        + " / ".join(f"{bound:.2f}x" for bound in ceiling["at_tau"])
        + "\n"
        f"chosen tree {chosen['tree']['name']} ({chosen['nodes']} tokens): "
        f"expected {chosen['expected_tokens']:.2f} tokens per step, "
        f"step cost {chosen['cost']:.2f} plain steps, expected speedup {chosen['expected_speedup']:.2f}x"
        + (
            "\nwarning: no draft tree is expected to beat plain decoding on this machine: the head's "
            "acceptance is too low for what verifying and drafting cost here (train it longer, or decode "
            "without it)"
            if chosen["expected_speedup"] < 1.0
            else ""
        )
        + _timing_warning(record.get("timing_check"))
    )


def _timing_warning(check: dict | None) -> str:
    """A warning line when the one-token timings at the start and the end of tuning disagree."""
    if check is None or check["quiet"]:
        return ""
    before, after = (1000 * seconds for seconds in check["one_token_seconds"])
    return (
        f"\nwarning: one-token verification took {before:.1f} ms at the start of the timings and "
        f"{after:.1f} ms at the end ({100 * check['drift']:.0f}% apart, more than "
        f"{100 * check['tolerance']:.0f}%): something else was using the CPU, so the cost curve, and "
        "the chosen tree, may be wrong; rerun tune-tree on quiet cores"
    )
