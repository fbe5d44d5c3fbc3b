"""Which llama.cpp drafting settings make an EAGLE-3 head pay in llama.cpp, and by how much
(docs/engines.md, "In llama.cpp: draft length and early stop").

llama-server drafts a chain of up to ``--spec-draft-n-max`` tokens a step and stops a chain early
when the draft's top probability falls under ``--spec-draft-p-min`` (common/speculative.cpp,
``draft``). Both trade drafting time against accepted tokens, and the best point depends on the
head and on what a draft forward costs next to the base's. This script serves the base's f32 GGUF
plainly and with each (chain, p_min) setting, one server each, all up at once, and sends every
prompt to every server in turn (prompt by prompt, so a slow spell of the machine hits all
settings alike), greedy, one request at a time, repeated ``--repeats`` times. It reports, per
setting, the server's decode rate (its own ``predicted_per_second`` timings: prompt processing
excluded; the median over repeats of the total over prompts), the client's wall time (prefill
included), tau (tokens per verification step, plain = 1) and whether every output equals the plain
server's.

    python scripts/llamacpp_draft_sweep.py OUT_DIR --heads eagle3-smollm2 \\
        [--prompts mt-bench] [--limit 16] [--max-new-tokens 128] [--settings 1:0 2:0 3:0 3:0.5] \\
        [--repeats 2]

Writes OUT_DIR/sweep.json and OUT_DIR/sweep.md (with the machine's CPU and flags).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DraftSetting:
    chain: int  # --spec-draft-n-max
    p_min: float  # --spec-draft-p-min (0: draft the whole chain every step)

    @property
    def name(self) -> str:
        return f"eagle3 chain {self.chain}, p_min {self.p_min:g}"


@dataclass
class Row:
    """One server's figures over every prompt, per repeat."""

    name: str
    tokens: list[int] = field(default_factory=list)  # generated tokens, per repeat
    decode_seconds: list[float] = field(default_factory=list)  # server's predicted_ms, per repeat
    wall_seconds: list[float] = field(default_factory=list)  # client's time, per repeat
    outputs: list[list[int]] = field(default_factory=list)  # first repeat's outputs, per prompt
    drafts: int = 0  # the server's counters over the whole run
    accepted: int = 0

    def summary(self, plain: Row | None) -> dict:
        decode = statistics.median(t / s for t, s in zip(self.tokens, self.decode_seconds))
        wall = statistics.median(t / s for t, s in zip(self.tokens, self.wall_seconds))
        # every step emits one token of the base's own besides the drafts it accepts
        total = sum(self.tokens)
        summary = {
            "setting": self.name,
            "decode_tokens_per_second": round(decode, 1),
            "wall_tokens_per_second": round(wall, 1),
            "tau": round(total / (total - self.accepted), 2) if self.drafts else 1.0,
            "accepted_per_draft": round(self.accepted / self.drafts, 3) if self.drafts else None,
        }
        if plain is not None:
            summary["decode_speedup"] = round(decode / plain.summary(None)["decode_tokens_per_second"], 2)
            summary["wall_speedup"] = round(wall / plain.summary(None)["wall_tokens_per_second"], 2)
            summary["output_equals_plain"] = self.outputs == plain.outputs
        return summary


def parse_setting(text: str) -> DraftSetting:
    chain, _, p_min = text.partition(":")
    return DraftSetting(int(chain), float(p_min or 0))


def prompt_ids(prompts: str, limit: int) -> list[list[int]]:
    """The eval set's first turns as the base's chat-template ids, spread over its categories."""
    from draftheads.base_model import load_tokenizer
    from draftheads.bench import build_prompts

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    return [p.input_ids[0].tolist() for p in build_prompts(prompts, tokenizer, limit)]


def export_draft(head: str, out: Path) -> Path:
    """Our ``gguf`` export of ``head`` (the CLI, as a user runs it)."""
    from draftheads.export.gguf import GGUF_NAME

    draftheads = Path(sys.executable).parent / "draftheads"
    command = [str(draftheads), "export", "--heads", head, "--format", "gguf", "--out", str(out)]
    subprocess.run(command, check=True, capture_output=True)
    return out / GGUF_NAME


def sweep(args: argparse.Namespace, work: Path) -> list[dict]:
    from draftheads.base_model import locate_embedded
    from draftheads.distributed import free_port
    from draftheads.export.gguf import write_dequantized_gguf
    from draftheads.serving import llamacpp

    target = work / "base-f32.gguf"
    write_dequantized_gguf(locate_embedded("smollm2-135m-instruct"), target)
    draft = export_draft(args.heads, work / "draft")
    ids = prompt_ids(args.prompts, args.limit)
    settings = [parse_setting(s) for s in args.settings]
    rows = [Row("plain")] + [Row(s.name) for s in settings]
    flags = [[]] + [llamacpp.draft_flags(draft, s.chain, p_min=s.p_min) for s in settings]
    with contextlib.ExitStack() as stack:
        ports = []
        for row, extra in zip(rows, flags):
            port = free_port()
            command = llamacpp.parallel_server_command(target, port, 1, 2048, extra)
            stack.enter_context(llamacpp.running_server(command, port, work / f"{len(ports)}.log"))
            ports.append(port)
        for prompt in ids[:2]:  # warm-up: first-request allocations and caches, not timed
            for port in ports:
                llamacpp.complete(port, prompt, 16)
        before = [llamacpp.spec_counts(llamacpp.request(p, "/metrics").decode()) for p in ports]
        for repeat in range(args.repeats):
            for row in rows:
                row.tokens.append(0), row.decode_seconds.append(0.0), row.wall_seconds.append(0.0)
            for prompt in ids:
                for row, port in zip(rows, ports):
                    started = time.perf_counter()
                    answer = llamacpp.complete(port, prompt, args.max_new_tokens)
                    row.wall_seconds[-1] += time.perf_counter() - started
                    row.tokens[-1] += answer["timings"]["predicted_n"]
                    row.decode_seconds[-1] += answer["timings"]["predicted_ms"] / 1000
                    if repeat == 0:
                        row.outputs.append(answer["tokens"])
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
        for row, port, earlier in zip(rows, ports, before):
            counts = llamacpp.spec_counts(llamacpp.request(port, "/metrics").decode()) or {}
            row.drafts = counts.get("drafts", 0) - ((earlier or {}).get("drafts", 0))
            row.accepted = counts.get("accepted_tokens", 0) - ((earlier or {}).get("accepted_tokens", 0))
    return [row.summary(None if row is rows[0] else rows[0]) for row in rows]


def record_header(script: str, record: dict) -> list[str]:
    """The first lines of a run's markdown: the command's settings, the machine, llama.cpp, the date."""
    machine = record["machine"]
    cpu = f"{machine['cpu']}, {machine['cores']} cores, flags {' '.join(machine['cpu_flags'])}"
    return [
        f"`scripts/{script}`: {record['settings']}",
        "",
        f"Machine: {cpu}; {record['llamacpp']}; {record['date']}.",
        "",
    ]


def write_run(out: Path, stem: str, record: dict, text: str) -> None:
    """``out/STEM.json`` (the record) and ``out/STEM.md`` (``text``), printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1, default=asdict) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(text)


def markdown(results: list[dict], record: dict) -> str:
    lines = [
        *record_header("llamacpp_draft_sweep.py", record),
        "| setting | decode tok/s | x plain | wall tok/s | x plain | tau | accepted/draft | output = plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['setting']} | {r['decode_tokens_per_second']} | {r.get('decode_speedup', 1.0)}x "
            f"| {r['wall_tokens_per_second']} | {r.get('wall_speedup', 1.0)}x | {r['tau']} "
            f"| {r['accepted_per_draft'] if r['accepted_per_draft'] is not None else '-'} "
            f"| {'yes' if r.get('output_equals_plain', True) else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """OUT_DIR, the head and the prompts: what the llama.cpp scripts share."""
    parser.add_argument("out", type=Path)
    parser.add_argument("--heads", default="eagle3-smollm2", help="an EAGLE-3 head (short name or directory)")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)


def run_record(args: argparse.Namespace, results: list[dict]) -> dict:
    """The record of a run: its settings (``args`` but OUT_DIR), the machine, llama.cpp's
    version, ``results`` and the date."""
    from draftheads.machine import cpu_flags, cpu_name
    from draftheads.serving import llamacpp

    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": len(os.sched_getaffinity(0))},
        "llamacpp": llamacpp.version(),
        "environment": {name: value for name, value in os.environ.items() if name.startswith("LLAMA_")},
        "results": results,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--settings", nargs="+", default=["1:0", "2:0", "3:0", "3:0.5", "4:0.5"])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if (args.out / "sweep.json").exists():
        parser.error(f"{args.out / 'sweep.json'} exists: choose another OUT_DIR")
    with tempfile.TemporaryDirectory(prefix="llamacpp-sweep-") as work:
        results = sweep(args, Path(work))
    record = run_record(args, results)
    write_run(args.out, "sweep", record, markdown(results, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
