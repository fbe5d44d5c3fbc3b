"""The README's results table, built from ``draftheads bench`` results (bench.json files).

One row per drafting method of a shipped head (``draftheads.shipped``) in each file, over all of its
prompts: tau, the speedup over the file's plain-decoding baseline and over prompt lookup when the
same run measured it, the machine, the date (the result folder's ``YYYY-MM-DD-`` prefix) and the
commit that recorded the file. Run from the repository root; prints Markdown:

    .venv/bin/python scripts/results_table.py [BENCH_JSON ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draftheads.shipped import SHIPPED_HEADS

ROOT = Path(__file__).resolve().parents[1]
# The results the README shows (the default when no file is given).
README_RESULTS = (
    "docs/results/2026-12-02-mtbench-b1-t0/bench.json",
    "docs/results/2026-12-02-humaneval-b1-t0/bench.json",
    "docs/results/2026-12-02-mtbench-b4-t0/bench.json",
    "docs/results/2026-12-02-mtbench-b1-t1/bench.json",
    "docs/results/2026-11-24-dflash-vs-eagle3-mtbench/bench.json",
    "docs/results/2026-12-02-gemma3-mtbench-b1-t0/bench.json",
)
PLAIN, PROMPT_LOOKUP = "generate", "prompt-lookup"
COLUMNS = (
    "head",
    "drafting",
    "batch",
    "prompts",
    "tau",
    "speedup",
    "baseline (speedup 1.00x)",
    "over prompt lookup",
    "machine",
    "date",
    "commit",
)
PROMPT_NAMES = {"mt-bench": "MT-bench", "humaneval": "HumanEval"}


def shipped_name(head_dir_name: str) -> str | None:
    """The short name of the shipped head whose directory is called ``head_dir_name``, if any."""
    for name, directory in SHIPPED_HEADS.items():
        if Path(directory).name == head_dir_name:
            return name
    return None


def drafting(method: str, tree: str | None, continuous: bool) -> str:
    """A bench method name (``eagle3+context/adaptive``) and its run's settings in words."""
    kind, _, variant = method.partition("/")
    words = ["head + context drafts" if kind.endswith("+context") else "head alone"]
    words.append(f"tree {tree}" if tree else "tuned tree")
    if variant == "adaptive":
        words.append("adaptive")
    if continuous:
        words.append("continuous batching")
    return ", ".join(words)


def machine(info: dict) -> str:
    """The CPU (or device), its threads, and the vector extensions the speed depends on."""
    if info.get("device", "cpu") != "cpu":
        return str(info.get("gpu") or info["device"])
    flags = set(info.get("cpu_flags", ()))
    named = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512_BF16"))
    extensions = [name for flag, name in named if flag in flags]
    if not extensions and "avx512f" in flags:
        extensions.append("AVX-512")
    elif not extensions and "avx2" in flags:
        extensions.append("AVX2")
    return ", ".join([info.get("cpu", "?"), f"{info.get('cpu_threads', '?')} threads", *extensions])


PLAIN_RUNS = {
    "generate@fp32-default": "HF `generate`, float32, default kernels",
    "generate@fp32-packed": "HF `generate`, float32, packed",
    "generate@bf16": "HF `generate`, bfloat16",
}


def baseline(settings: dict, summary: dict) -> str:
    """What a row's speedup is relative to: the fastest plain decoding its run measured (and which
    one), or, in runs from before ``bench`` timed several, its one plain ``generate`` run."""
    fastest = summary.get("fastest_plain")
    if fastest:
        return f"fastest plain: {PLAIN_RUNS.get(fastest, fastest)}"
    packed = ", packed" if settings.get("pack") else ""
    return f"HF `generate`, {settings.get('dtype', '?')}{packed}"


def speedup(summary: dict) -> float:
    """The speedup over the fastest plain decoding where the run measured it, else over its one
    plain ``generate`` run."""
    return summary.get("speedup_over_fastest_plain") or summary["speedup"]


def recorded_by(path: Path) -> tuple[str, str]:
    """(short hash, date) of the oldest commit holding ``path``'s exact content (found by content,
    so a file moved since keeps its commit); ("uncommitted", "") when none does."""
    blob = subprocess.run(
        ["git", "hash-object", str(path)], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    log = subprocess.run(
        ["git", "log", "--format=%h %cs", f"--find-object={blob}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    entries = [line.split() for line in log if line.strip()]
    return (entries[-1][0], entries[-1][1]) if entries else ("uncommitted", "")


def folder_date(path: Path) -> str | None:
    """The ``YYYY-MM-DD`` that starts the name of ``path``'s folder, if it has one."""
    prefix = path.parent.name[:10]
    parts = prefix.split("-")
    return prefix if len(parts) == 3 and all(part.isdigit() for part in parts) else None


def rows(path: Path, report: dict, commit: str, date: str) -> list[dict[str, str]]:
    """The table rows of one bench.json: each shipped head's methods, over all prompts."""
    settings = report["settings"]
    overall = [s for s in report["summaries"] if s["category"] == "all"]
    lookup = {s.get("batch_size", 1): s for s in overall if s["method"] == PROMPT_LOOKUP}
    prompts = f"{PROMPT_NAMES.get(settings['prompts'], settings['prompts'])} ({overall[0]['prompts']})"
    if settings.get("temperature"):
        prompts += f", T={settings['temperature']:g}"
    out = []
    for summary in overall:
        method, _, head_dir_name = summary["method"].partition(":")
        head = shipped_name(head_dir_name.split("@")[0])
        if head is None:
            continue
        batch = summary.get("batch_size", 1)
        over_lookup = lookup.get(batch)
        out.append(
            {
                "head": f"`{head}`",
                "drafting": drafting(method, settings.get("tree"), batch > 1 and settings.get("continuous")),
                "batch": str(batch),
                "prompts": prompts,
                "tau": f"{summary['tau']:.2f}",
                "speedup": f"**{speedup(summary):.2f}x**",
                "baseline (speedup 1.00x)": baseline(settings, summary),
                "over prompt lookup": (
                    f"{speedup(summary) / speedup(over_lookup):.2f}x" if over_lookup else "not run"
                ),
                "machine": machine(report["machine"]),
                "date": date,
                "commit": commit,
            }
        )
    return out


def table(paths: list[Path]) -> str:
    """The Markdown table of every shipped head's rows in ``paths``, in the order given."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for path in paths:
        commit, commit_date = recorded_by(path)
        date = folder_date(path) or commit_date
        for row in rows(path, json.loads(path.read_text()), commit, date):
            lines.append("| " + " | ".join(row[column] for column in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or [ROOT / path for path in README_RESULTS]
    print(table(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
