"""Does an EAGLE-3 head draft as well in llama-server with several slots as with one
(docs/engines.md, "In llama.cpp: several slots")?

The same two GGUFs (the base in f32 and our ``gguf`` export of the head), the same prompts, greedy;
one llama-server per setting ``SLOTS:CONCURRENCY[:OPTION...]``: ``-np SLOTS`` parallel slots, the
prompts sent ``CONCURRENCY`` at a time (each wave waits for its slowest request), drafting with
draftheads' flags (``serving.llamacpp.draft_flags``) and each OPTION's (``OPTIONS``: ``unified``,
one KV cache for the slots; ``backend-sampling``, llama.cpp's default draft sampling). Per request
the server's own counts (``timings.draft_n``, ``timings.draft_n_accepted``), per server its
counters by draft depth (``/metrics``), whether every output equals a one-slot plain server's, and
the client's tokens/s beside a plain server's with the same slots and concurrency.

    python scripts/llamacpp_slots.py OUT_DIR [--heads eagle3-smollm2] [--limit 16] \\
        [--max-new-tokens 128] [--chain 3] [--settings 1:1 4:1 4:4 4:4:backend-sampling]

Writes OUT_DIR/slots.json and OUT_DIR/slots.md (with the machine's CPU and flags).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llamacpp_draft_sweep import (
    add_run_arguments,
    export_draft,
    prompt_ids,
    record_header,
    run_record,
    write_run,
)

CONTEXT_PER_SLOT = 2048


# Setting options after SLOTS:CONCURRENCY, and the llama-server flags each adds.
OPTIONS = {
    "unified": ["--kv-unified"],  # one KV cache shared by the slots
    # llama.cpp's default, which draftheads' draft flags turn off (serving.llamacpp.DRAFT_SAMPLING)
    "backend-sampling": ["--spec-draft-backend-sampling"],
}


@dataclass(frozen=True)
class SlotSetting:
    slots: int  # -np
    concurrency: int  # requests in flight at once
    options: tuple[str, ...] = ()  # keys of OPTIONS

    @property
    def name(self) -> str:
        extra = "".join(f", {option}" for option in self.options)
        return f"{self.slots} slot{'s' if self.slots > 1 else ''}{extra}, {self.concurrency} at a time"

    @property
    def flags(self) -> list[str]:
        return [flag for option in self.options for flag in OPTIONS[option]]


def parse_setting(text: str) -> SlotSetting:
    parts = text.split(":")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]) or set(parts[2:]) - set(OPTIONS):
        raise argparse.ArgumentTypeError(
            f"--settings: '{text}' is not SLOTS:CONCURRENCY[:OPTION...], OPTION one of {', '.join(OPTIONS)}"
        )
    return SlotSetting(int(parts[0]), int(parts[1]), tuple(parts[2:]))


def run_waves(port: int, prompts: list[list[int]], concurrency: int, max_new_tokens: int) -> list[dict]:
    """Every prompt's completion, ``concurrency`` requests in flight at a time, in prompt order."""
    from draftheads.serving import llamacpp

    answers: list[dict] = []
    with ThreadPoolExecutor(concurrency) as pool:
        for start in range(0, len(prompts), concurrency):
            wave = prompts[start : start + concurrency]
            answers += pool.map(lambda ids: llamacpp.complete(port, ids, max_new_tokens), wave)
    return answers


def serve(target: Path, flags: list[str], setting: SlotSetting, prompts, args, log: Path) -> dict:
    """One server's answers to every prompt and its counters."""
    from draftheads.distributed import free_port
    from draftheads.serving import llamacpp

    port = free_port()
    command = llamacpp.parallel_server_command(target, port, setting.slots, CONTEXT_PER_SLOT, flags)
    command += setting.flags
    if flags:
        command += shlex.split(args.server_flags)
    with llamacpp.running_server(command, port, log):
        started = time.perf_counter()
        answers = run_waves(port, prompts, setting.concurrency, args.max_new_tokens)
        seconds = time.perf_counter() - started
        counts = llamacpp.spec_counts(llamacpp.request(port, "/metrics").decode()) or {}
    return {"answers": answers, "counts": counts, "command": command, "seconds": seconds}


def summary(setting: SlotSetting, served: dict, plain: list[list[int]]) -> dict:
    answers, counts = served["answers"], served["counts"]
    per_request = [(a["timings"].get("draft_n", 0), a["timings"].get("draft_n_accepted", 0)) for a in answers]
    drafted, accepted = sum(d for d, _ in per_request), sum(a for _, a in per_request)
    drafts = counts.get("drafts", 0)
    by_depth = [round(n / drafts, 3) for n in counts.get("accepted_per_position", [])] if drafts else []
    return {
        "setting": setting.name,
        "slots": setting.slots,
        "concurrency": setting.concurrency,
        "options": list(setting.options),
        "tokens_per_second": round(sum(len(a["tokens"]) for a in answers) / served["seconds"], 1),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "accepted_per_drafted": round(accepted / drafted, 3) if drafted else None,
        "acceptance_by_depth": by_depth,
        "per_request_accepted_per_drafted": [round(a / d, 3) if d else None for d, a in per_request],
        "per_request_slot": [a.get("slot") for a in answers],
        "outputs_equal_plain": sum(a["tokens"] == p for a, p in zip(answers, plain)),
        "requests": len(answers),
        "command": served["command"],
    }


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    from draftheads.base_model import locate_embedded
    from draftheads.export.gguf import write_dequantized_gguf
    from draftheads.serving import llamacpp

    target = work / "base-f32.gguf"
    write_dequantized_gguf(locate_embedded("smollm2-135m-instruct"), target)
    draft = export_draft(args.heads, work / "draft")
    prompts = prompt_ids(args.prompts, args.limit)
    plain = {(1, 1): serve(target, [], SlotSetting(1, 1), prompts, args, work / "plain.log")}
    reference = [a["tokens"] for a in plain[1, 1]["answers"]]
    results = []
    for index, setting in enumerate(args.settings):
        shape = (setting.slots, setting.concurrency)
        if shape not in plain:
            plain[shape] = serve(target, [], SlotSetting(*shape), prompts, args, work / f"plain-{index}.log")
        flags = llamacpp.draft_flags(draft, args.chain)
        served = serve(target, flags, setting, prompts, args, work / f"{index}.log")
        results.append(summary(setting, served, reference))
        results[-1]["plain_tokens_per_second"] = summary(SlotSetting(*shape), plain[shape], reference)[
            "tokens_per_second"
        ]
        print(f"{setting.name}: accepted per drafted {results[-1]['accepted_per_drafted']}", file=sys.stderr)
    return results


def markdown(results: list[dict], record: dict) -> str:
    lines = [
        *record_header("llamacpp_slots.py", record),
        "| setting | accepted / drafted | by depth | per request | outputs = plain | tokens/s | plain |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        depth = " / ".join(f"{v:.2f}" for v in r["acceptance_by_depth"]) or "-"
        each = " ".join("-" if v is None else f"{v:.2f}" for v in r["per_request_accepted_per_drafted"])
        lines.append(
            f"| {r['setting']} | {r['accepted_per_drafted']} | {depth} | {each} "
            f"| {r['outputs_equal_plain']}/{r['requests']} | {r['tokens_per_second']} "
            f"| {r['plain_tokens_per_second']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--chain", type=int, default=3, help="--spec-draft-n-max")
    parser.add_argument(
        "--settings",
        nargs="+",
        type=parse_setting,
        default=[parse_setting(s) for s in ("1:1", "4:1", "4:4", "4:4:backend-sampling")],
    )
    parser.add_argument(
        "--server-flags",
        default="",
        help='more llama-server flags for the drafting servers: --server-flags="-b 8192"',
    )
    args = parser.parse_args(argv)
    if (args.out / "slots.json").exists():
        parser.error(f"{args.out / 'slots.json'} exists: choose another OUT_DIR")
    with tempfile.TemporaryDirectory(prefix="llamacpp-slots-") as work:
        results = measure(args, Path(work))
    record = run_record(args, results)
    record["settings"]["settings"] = [s.name for s in args.settings]
    write_run(args.out, "slots", record, markdown(results, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
