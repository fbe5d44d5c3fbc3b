"""Exports proven in real engines: every shipped head an engine can draft with (``UNSERVED_HEADS``
are listed, not run), written in every engine format that fits it, is loaded by the engine that
serves that format and decoded greedily in fp32.

    .venv/bin/python engines/check.py --out docs/results/engines

Run with the project's own virtualenv; the engines run in theirs (``make engines`` builds them), as
subprocesses that import nothing from draftheads (``vllm_decode.py``, ``speculators_check.py``);
llama.cpp runs as its own server, driven over HTTP (``draftheads.serving.llamacpp``). ``--engines``
limits a run.
For each (head, format) it checks:

(a) the engine's output with the draft equals the engine's output without one, token for token;
(b) the engine's acceptance counts (drafts, accepted tokens per position) equal ours for the same
    chain: ``SpeculativeGenerator`` with a chain tree of ``--chain`` tokens (a block head's whole
    block, ``engine_chain``), the head alone (no context drafter, not adaptive), on the same prompt ids;
In llama.cpp (the ``gguf`` export, drafting for the base's GGUF dequantised to f32), (a) holds as is
and (b) within ``LLAMACPP_ACCEPTANCE_TOLERANCE``: its kernels round differently from torch's.
(c) speculators loads our speculators exports (EAGLE-3, DFlash) with no missing or unexpected keys and
    every tensor as written, and its converters turn our eagle3 / dflash exports into the same tensors.
(d) ``vllm serve``, the OpenAI-compatible server, with the eagle3 export as the draft and with the
    speculators export as the model: one-turn chats over HTTP get the prompt ids we make, the offline
    run's answers (token ids and text) and its acceptance counts (``HTTP_FORMATS``).

fp32 throughout: vLLM-CPU in bf16 is not batch-invariant even without a draft, so bf16 outputs may
differ for reasons that are not the draft's. A format no shipped head fits, or an engine that
cannot run it here, is reported as such (with the engine's own error), never skipped silently.
Writes ``report.json`` and ``report.md`` to ``--out``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftheads.serving import llamacpp
from draftheads.shipped import SHIPPED_HEADS

ROOT = Path(__file__).resolve().parent.parent
ENGINES = Path(__file__).resolve().parent
VENVS = ENGINES / ".venvs"  # made by `make engines`
PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a string.",
    "List three facts about the Moon.",
    "What is the capital of France, and why is it famous?",
)
# Which engine loads each of our export formats, and how it is told to draft with it. A speculators
# layout names its verifier and its draft length itself: vLLM is pointed at the export and finds the
# base. vLLM-CPU runs DFlash since vllm-project/vllm#44029 (CPU kernel for the block inputs; its CPU
# attention backend takes the non-causal block, vllm/v1/attention/backends/cpu_attn.py).
VLLM_METHODS = {
    "eagle3": "eagle3",
    "eagle": "eagle",
    "medusa-vllm": "medusa",
    "speculators": None,
    "dflash": "dflash",
    "dflash-speculators": None,
}
# Formats llama.cpp loads (draftheads.serving.llamacpp): the gguf export drafts for the base's GGUF,
# dequantised to f32 (the dtype whose greedy output is llama.cpp's reference for its own speculation).
LLAMACPP_FORMATS = ("gguf",)
# The engines a run may be limited to (``--engines``): vLLM (with the speculators package check) and
# llama.cpp. Formats no engine here serves are reported in runs that include vLLM, as before llama.cpp.
ENGINE_NAMES = ("vllm", "llama.cpp")
# What a run checks unless told (``--engines``): every engine (`make engines` builds them all).
DEFAULT_ENGINES = ENGINE_NAMES
# llama.cpp's accepted tokens per draft may differ from ours (other kernels, other rounding) but not by
# much: the same weights in f32 draft the same tokens except at near-ties. A larger relative gap in
# accepted tokens per draft is a bug (a mis-mapped tensor drops acceptance to near zero).
LLAMACPP_ACCEPTANCE_TOLERANCE = 0.1
# Formats this check has no engine for, and why (reported, not skipped silently).
NO_ENGINE_HERE = {
    # docs.sglang.io, "CPU Servers": built from source or Docker, for Intel Xeons with AMX
    "eagle-sglang": "SGLang's PyPI wheels are CUDA builds and its CPU backend is built from source "
    "(for Intel Xeons with AMX); this check installs its engines from PyPI",
}


# Statuses that fail the check: a mismatch, or an engine that could not load or run an export.
FAILING = ("fail", "engine-error")
# Per speculators algorithm: the release layout its converter reads (speculators convert/:
# Eagle3Converter, DFlashConverter) and our speculators layout of the same head.
SPECULATORS_PAIRS = {"eagle3": ("eagle3", "speculators"), "dflash": ("dflash", "dflash-speculators")}
# speculators algorithms, each named as the head kind it holds, that speculators loads but has no
# converter for from a layout of ours: our export of it, checked for loading alone (models/peagle).
SPECULATORS_LOAD_ONLY = {"peagle": "speculators"}


# Shipped heads that no engine here can draft with, and why (docs/architecture.md, "Adding a base
# architecture"): left out of the default heads and listed in the report as "unserved".
UNSERVED_HEADS = {
    "eagle3-gemma3": "vLLM 0.32's Gemma3ForCausalLM lacks SupportsEagle3, and llama.cpp's gemma3 graph "
    "records no layer inputs for an EAGLE-3 drafter",
}


@dataclass(frozen=True)
class CheckSettings:
    """What the check decodes; every default is defined here."""

    # shipped heads' short names, or head directories
    heads: tuple[str, ...] = tuple(name for name in SHIPPED_HEADS if name not in UNSERVED_HEADS)
    engines: tuple[str, ...] = DEFAULT_ENGINES  # the engines checked (of ``ENGINE_NAMES``)
    out: Path = ROOT / "docs" / "results" / "engines"
    prompts: tuple[str, ...] = PROMPTS
    max_new_tokens: int = 64
    chain: int = 3  # draft tokens per step: vLLM's num_speculative_tokens, our chain depth (engine_chain)
    max_model_len: int = 1024
    enforce_eager: bool = True  # vLLM-CPU's torch.compile warm-up costs minutes per engine start here
    engine_timeout: int = 900  # seconds for one engine subprocess


@dataclass
class Outcome:
    """One (head, format) pair: what was run and what was found."""

    head: str
    kind: str
    format: str
    engine: str
    status: str  # pass | fail | engine-error | no-engine | refused | unserved
    checks: dict = field(default_factory=dict)  # check name -> bool
    details: dict = field(default_factory=dict)
    error: str | None = None


# ---- comparisons (pure) -------------------------------------------------------------------------


def first_difference(expected: list[list[int]], got: list[list[int]]) -> dict | None:
    """Where two sets of per-prompt token lists first differ (None when identical)."""
    if len(expected) != len(got):
        return {"prompts": [len(expected), len(got)]}
    for prompt, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return {
                "prompt": prompt,
                "token": index,
                "expected": a[index : index + 4],
                "got": b[index : index + 4],
            }
    return None


def acceptance_matches(ours: dict, engine: dict) -> bool:
    """Same number of drafts and the same accepted count at every draft position."""
    width = max(len(ours["accepted_per_position"]), len(engine["accepted_per_position"]))

    def padded(counts: list[int]) -> list[int]:
        return list(counts) + [0] * (width - len(counts))

    return ours["drafts"] == engine["drafts"] and padded(ours["accepted_per_position"]) == padded(
        engine["accepted_per_position"]
    )


def format_engine(name: str) -> str:
    """The engine that serves export format ``name`` here: "vllm", "llama.cpp" or "none"."""
    if name in LLAMACPP_FORMATS:
        return "llama.cpp"
    return "vllm" if name in VLLM_METHODS else "none"


def format_selected(name: str, engines: tuple[str, ...]) -> bool:
    """Is ``name`` checked in a run of ``engines``? Formats without an engine go with vLLM's."""
    engine = format_engine(name)
    return engine in engines or (engine == "none" and "vllm" in engines)


def engine_formats(kind: str, engines: tuple[str, ...]) -> list[str]:
    """The engine formats that hold a ``kind`` head and are checked in a run of ``engines``."""
    from draftheads.export import formats_for

    return [name for name in formats_for(kind) if name != "draftheads" and format_selected(name, engines)]


def acceptance_gap(ours: dict, engine: dict) -> float | None:
    """Relative difference of the engine's accepted tokens per draft from ours (None: nothing drafted)."""
    if not ours["drafts"] or not engine["drafts"]:
        return None
    mine = sum(ours["accepted_per_position"]) / ours["drafts"]
    theirs = sum(engine["accepted_per_position"]) / engine["drafts"]
    return abs(theirs - mine) / mine if mine else float(theirs > 0)


def speculators_checks(result: dict) -> dict[str, bool]:
    """(c) as booleans from ``speculators_check.py``'s result."""
    load = result.get("load", {})
    checks = {
        "speculators_loads": "error" not in load
        and not load.get("missing")
        and not load.get("unexpected")
        and not load.get("altered"),
    }
    if "convert" in result:  # absent for a load-only algorithm
        convert = result["convert"]
        checks["converter_round_trip"] = (
            "error" not in convert
            and not convert.get("only_converted")
            and not convert.get("only_ours")
            and not convert.get("differing")
            and not convert.get("config_differences")
        )
    return checks


# ---- our side -----------------------------------------------------------------------------------


def prompt_ids(tokenizer, prompts: tuple[str, ...]) -> list[list[int]]:
    """Each prompt as a one-turn chat, the ids every engine is given (no tokenizer differences)."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
        )
        for p in prompts
    ]


def engine_chain(head, chain: int) -> int:
    """Draft tokens per step for ``head``, in the engines and ours: ``chain``, but a block head's whole
    block and a causal-block head's trained depths. vLLM drafts DFlash as one block of
    1 + num_speculative_tokens rows that attend to each other (vllm/v1/spec_decode/dflash.py,
    ``set_inputs_first_pass``) and P-EAGLE as the root's row and num_speculative_tokens - 1 mask rows
    (llm_base_proposer.py, parallel drafting); we always draft the trained block or depths, so both
    draft the same tokens only at those lengths."""
    return head.num_draft_steps if head.drafting in ("block", "causal-block") else chain


def decode_ours(base_model, tokenizer, head, ids: list[list[int]], chain: int, max_new_tokens: int) -> dict:
    """Our greedy outputs and acceptance counts with a chain of ``chain`` draft tokens."""
    from draftheads.infer.generate import SpeculativeGenerator
    from draftheads.infer.tree import chain_choices

    # The head alone, as the engines draft: no context drafts merged in, no adaptive pruning.
    generator = SpeculativeGenerator(
        base_model, head, tokenizer, tree=chain_choices(chain), context=False, adaptive=False
    )
    outputs, drafts, per_position = [], 0, [0] * chain
    for prompt in ids:
        result = generator.generate(prompt, max_new_tokens=max_new_tokens)
        outputs.append(result.new_tokens)
        drafts += result.stats.verification_steps
        for depth, count in enumerate(result.stats.accepted_per_depth):
            per_position[depth] += count
    return {"outputs": outputs, "drafts": drafts, "accepted_per_position": per_position}


# ---- the engines --------------------------------------------------------------------------------


def venv_python(name: str) -> Path:
    python = VENVS / name / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"engines/check.py: {python} is missing; build the engine venvs with `make engines`")
    return python


def vllm_environment() -> dict[str, str]:
    """vLLM-CPU's recommended setup (its CPU installation docs): tcmalloc and the bundled Intel
    OpenMP preloaded, OpenMP threads bound to the cores this process may use, none reserved."""
    env = dict(os.environ)
    venv = VENVS / "vllm"
    preload = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv / "lib" / "libiomp5.so"]
    env["LD_PRELOAD"] = ":".join(str(p) for p in preload if p.is_file())
    cores = sorted(os.sched_getaffinity(0))
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would reserve more than needed
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_engine(script: str, venv: str, request: dict, work: Path, name: str, env, timeout: int) -> dict:
    """Run one engine script in its venv on ``request``; its result, or the error that stopped it."""
    request_path, result_path, log_path = (
        work / f"{name}.{s}" for s in ("request.json", "result.json", "log")
    )
    request_path.write_text(json.dumps(request))
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            completed = subprocess.run(
                [str(venv_python(venv)), str(ENGINES / script), str(request_path), str(result_path)],
                check=False,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s (log: {log_path})"}
    if not result_path.is_file():
        tail = log_path.read_text()[-2000:]
        return {"error": f"{script} exited {completed.returncode} without a result:\n{tail}"}
    result = json.loads(result_path.read_text())
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    return result


def export(
    head_dir: Path, format_name: str, out: Path, verifier: str, chain: int, target_gguf: str | None = None
) -> str | None:
    """Write ``head_dir`` in ``format_name`` with our own CLI; None, or our writer's refusal."""
    command = [
        str(Path(sys.executable).parent / "draftheads"),
        "export",
        "--heads",
        str(head_dir),
        "--format",
        format_name,
        "--out",
        str(out),
        "--verifier",
        verifier,
        "--speculative-tokens",
        str(chain),
    ] + (["--target-gguf", target_gguf] if target_gguf else [])
    completed = subprocess.run(command, check=False, capture_output=True, text=True)
    return None if completed.returncode == 0 else (completed.stderr or completed.stdout).strip()


# ---- heads --------------------------------------------------------------------------------------

# Fresh (untrained, seeded) heads for the kinds no shipped head has, so that every format is loaded
# by its engine: their acceptance is near zero, but the layout, output and count checks still hold.
UNTRAINED_HEADS = {
    "eagle": {"kind": "eagle", "fc_bias": False},  # vLLM's EagleLlamaForCausalLM has no fc bias
    "medusa": {"kind": "medusa", "num_heads": 3, "shared_lm_head": True},
    "mtp": {"kind": "mtp"},
    # Qwen3 layers, the only DFlash layer the engines build (draftheads.export.dflash); a block of 4
    # drafts a chain of 3, as the other fresh heads do.
    "dflash": {"kind": "dflash", "layer_architecture": "qwen3", "block_size": 4},
    # Three depths in one forward, the chain of 3 the other fresh heads draft.
    "peagle": {"kind": "peagle", "ttt_steps": 3},
}
UNTRAINED_SEED = 0


def resolve_heads(heads: tuple[str, ...]) -> list[Path]:
    """The directories of ``heads`` (short names or paths, ``draftheads.shipped``)."""
    from draftheads.heads.base import resolve_head_dir

    return [resolve_head_dir(head) for head in heads]


def unserved_outcomes(heads: tuple[str, ...]) -> list[Outcome]:
    """One row per ``UNSERVED_HEADS`` entry this run leaves out, with the reason: reported, not
    skipped silently."""
    return [
        Outcome(name, head_kind(resolve_heads((name,))[0]), "-", "all", "unserved", error=reason)
        for name, reason in UNSERVED_HEADS.items()
        if name not in heads
    ]


def head_kind(head_dir: Path) -> str:
    return json.loads((head_dir / "config.json").read_text())["head_kind"]


def untrained_heads(base_model, base_name: str, kinds: list[str], work: Path) -> list[Path]:
    """Save a fresh head of each kind in ``kinds`` (``UNTRAINED_HEADS``) under ``work``."""
    import torch

    from draftheads.heads.base import build_head, head_config_from_dict

    directories = []
    for kind in kinds:
        torch.manual_seed(UNTRAINED_SEED)
        head = build_head(base_model, head_config_from_dict(UNTRAINED_HEADS[kind]), base_name)
        directories.append(head.save_pretrained(work / f"untrained-{kind}"))
    return directories


# ---- one base, its heads, their formats ----------------------------------------------------------


@dataclass(frozen=True)
class BaseRun:
    """What every head on one base shares: the base, the prompt ids, vLLM's output without a draft."""

    base_model: object
    tokenizer: object
    base_path: str  # the local HF directory every engine loads
    request: dict  # vLLM request fields common to every run
    reference: dict  # vLLM without a draft
    env: dict
    llamacpp: dict = field(default_factory=dict)  # ``llamacpp_base``: the f32 GGUF and its reference


def vllm_request(run: BaseRun, format_name: str, export_dir: Path, chain: int) -> dict:
    """vLLM's request for decoding with ``export_dir`` as the draft."""
    method = VLLM_METHODS[format_name]
    if method is None:  # speculators: the export is the model; its config names the verifier and
        # the draft length (``chain``, written by ``export``; dflash-speculators: block_size - 1)
        return {**run.request, "model": str(export_dir), "speculative_config": None}
    config = {"method": method, "model": str(export_dir), "num_speculative_tokens": chain}
    return {**run.request, "speculative_config": config}


def check_format(
    head_dir: Path,
    format_name: str,
    run: BaseRun,
    ours: dict | None,
    chain: int,
    settings: CheckSettings,
    work: Path,
) -> tuple[Outcome, Path | None]:
    """Export ``head_dir`` as ``format_name``, decode with it in its engine drafting ``chain`` tokens a
    step, compare (a) and (b)."""
    if format_name in LLAMACPP_FORMATS:
        return check_llamacpp(head_dir, format_name, run, ours, chain, settings, work)
    engine = "vllm" if format_name in VLLM_METHODS else "none"
    outcome = Outcome(head_dir.name, head_kind(head_dir), format_name, engine, status="pass")
    export_dir = work / f"{head_dir.name}.{format_name}"
    refusal = export(head_dir, format_name, export_dir, run.base_path, chain)
    if refusal:
        outcome.status, outcome.error = "refused", refusal
        return outcome, None
    if format_name in NO_ENGINE_HERE:
        outcome.status, outcome.error = "no-engine", NO_ENGINE_HERE[format_name]
        return outcome, export_dir
    if "error" in run.reference:
        outcome.status, outcome.error = "engine-error", f"vLLM without a draft: {run.reference['error']}"
        return outcome, export_dir
    request = vllm_request(run, format_name, export_dir, chain)
    name = f"{head_dir.name}.{format_name}"
    result = run_engine("vllm_decode.py", "vllm", request, work, name, run.env, settings.engine_timeout)
    if "error" in result:
        outcome.status, outcome.error = "engine-error", result["error"]
        return outcome, export_dir
    engine_counts = result["spec_decode"] or {"drafts": 0, "accepted_per_position": []}
    difference = first_difference(run.reference["outputs"], result["outputs"])
    outcome.checks = {
        "output_equals_engine_without_draft": difference is None,
        "acceptance_equals_ours": acceptance_matches(ours, engine_counts),
    }
    outcome.details = {
        "vllm_version": result["vllm_version"],
        "chain": chain,
        "engine_acceptance": engine_counts,
        "our_acceptance": {k: ours[k] for k in ("drafts", "accepted_per_position")},
        "first_difference": difference,
        "ours_equal_engine_without_draft": first_difference(run.reference["outputs"], ours["outputs"])
        is None,
        "engine_seconds": result["wall_seconds"],
    }
    return outcome, export_dir


# ---- llama.cpp ------------------------------------------------------------------------------------


def llamacpp_base(base_name: str, prompts: list[list[int]], settings: CheckSettings, work: Path) -> dict:
    """The base as llama.cpp runs it here: its embedded GGUF dequantised to f32 (the weights our
    fp32 copy holds), and llama.cpp's greedy outputs without a draft."""
    from draftheads.base_model import ALIASES, locate_embedded
    from draftheads.export.gguf import write_dequantized_gguf

    if base_name not in ALIASES:
        return {"error": f"the base '{base_name}' ships no GGUF; convert it with convert_hf_to_gguf.py"}
    target = work / "base-f32.gguf"
    write_dequantized_gguf(locate_embedded(base_name), target)
    log = work / "llamacpp-without-draft.log"
    return {
        "target": str(target),
        "reference": llamacpp.decode(target, prompts, settings.max_new_tokens, log),
    }


# What must be empty for our gguf export to be the converter's (``llamacpp.gguf_differences``).
CONVERTER_FIELDS = (
    "only_ours",
    "only_converted",
    "differing",
    "keys_only_ours",
    "keys_only_converted",
    "key_differences",
)


def converter_differences(head_dir: Path, ours: Path, run: BaseRun, chain: int, work: Path) -> dict:
    """llama.cpp's converter on our ``eagle3`` export of the head (with the base's HF directory as
    its target), compared with our ``gguf`` export; or the error that stopped it."""
    checkpoint = work / f"{head_dir.name}.eagle3-for-converter"
    refusal = export(head_dir, "eagle3", checkpoint, run.base_path, chain)
    if refusal:
        return {"error": f"eagle3 export: {refusal}"}
    converted = work / f"{head_dir.name}.converted.gguf"
    log = work / f"{head_dir.name}.converter.log"
    error = llamacpp.convert(checkpoint, Path(run.base_path), converted, log)
    return {"error": error} if error else llamacpp.gguf_differences(ours, converted)


def decode_in_llamacpp(
    outcome: Outcome, draft: Path, spec_type: str, run: BaseRun, ours: dict, chain: int, settings, log: Path
) -> dict:
    """Decode with ``draft`` in llama.cpp's server and set (a) and (b) on ``outcome``; the server's
    result (``{"error": ...}``, the outcome marked as an engine error, when it failed)."""
    reference = run.llamacpp.get("reference") or run.llamacpp
    if "error" in reference:
        outcome.status, outcome.error = "engine-error", f"llama.cpp without a draft: {reference['error']}"
        return reference
    target = Path(run.llamacpp["target"])
    prompts = run.request["prompts"]
    result = llamacpp.decode(
        target, prompts, settings.max_new_tokens, log, draft=draft, chain=chain, spec_type=spec_type
    )
    if "error" in result:
        outcome.status, outcome.error = "engine-error", result["error"]
        return result
    engine_counts = result["spec_decode"] or {"drafts": 0, "accepted_per_position": []}
    difference = first_difference(reference["outputs"], result["outputs"])
    gap = acceptance_gap(ours, engine_counts)
    outcome.checks = {
        "output_equals_engine_without_draft": difference is None,
        "acceptance_near_ours": gap is not None and gap <= LLAMACPP_ACCEPTANCE_TOLERANCE,
    }
    outcome.details = {
        "llamacpp_version": llamacpp.version(),
        "chain": chain,
        "engine_acceptance": engine_counts,
        "our_acceptance": {k: ours[k] for k in ("drafts", "accepted_per_position")},
        "acceptance_gap": gap,
        "acceptance_equals_ours": acceptance_matches(ours, engine_counts),
        "first_difference": difference,
        "ours_equal_engine_without_draft": first_difference(reference["outputs"], ours["outputs"]) is None,
        "engine_seconds": result["seconds"],
        "engine_seconds_without_draft": reference["seconds"],
        # the server's decode rate over every prompt (prompt processing excluded), with and without
        "decode_tokens_per_second": result["decode_tokens_per_second"],
        "decode_tokens_per_second_without_draft": reference["decode_tokens_per_second"],
        "server_command": result["command"],
    }
    return result


def check_llamacpp(
    head_dir: Path, format_name: str, run: BaseRun, ours: dict, chain: int, settings, work: Path
) -> tuple[Outcome, Path | None]:
    """(a) in llama.cpp's server: its output with our GGUF drafting ``chain`` tokens a step equals its
    output without a draft; its acceptance counts next to ours (``LLAMACPP_ACCEPTANCE_TOLERANCE``);
    and llama.cpp's converter writes what our writer does (``converter_agrees``)."""
    from draftheads.export.gguf import GGUF_NAME

    outcome = Outcome(head_dir.name, head_kind(head_dir), format_name, "llama.cpp", status="pass")
    export_dir = work / f"{head_dir.name}.{format_name}"
    refusal = export(head_dir, format_name, export_dir, run.base_path, chain, run.llamacpp.get("target"))
    if refusal:
        outcome.status, outcome.error = "refused", refusal
        return outcome, None
    log = work / f"{head_dir.name}.{format_name}.log"
    result = decode_in_llamacpp(
        outcome, export_dir / GGUF_NAME, "draft-eagle3", run, ours, chain, settings, log
    )
    if "error" not in result:
        converted = converter_differences(head_dir, export_dir / GGUF_NAME, run, chain, work)
        outcome.checks["converter_agrees"] = "error" not in converted and not any(
            converted[k] for k in CONVERTER_FIELDS
        )
        outcome.details["converter"] = converted
    return outcome, export_dir


# Release formats llama.cpp drafts with once its own converter (convert_hf_to_gguf.py,
# ``--target-model-dir``) has turned them into a GGUF: format -> llama-server's ``--spec-type``.
# DFlash: llama.cpp's DFlashModel reads the z-lab layout our ``dflash`` export writes.
LLAMACPP_CONVERTED = {"dflash": "draft-dflash"}


def check_llamacpp_converted(
    head_dir: Path, format_name: str, run: BaseRun, ours: dict, chain: int, settings, work: Path
) -> Outcome:
    """(a) and (b) in llama.cpp for a release format its converter reads (``LLAMACPP_CONVERTED``)."""
    outcome = Outcome(head_dir.name, head_kind(head_dir), format_name, "llama.cpp", status="pass")
    export_dir = work / f"{head_dir.name}.{format_name}.for-llamacpp"
    refusal = export(head_dir, format_name, export_dir, run.base_path, chain)
    if refusal:
        outcome.status, outcome.error = "refused", refusal
        return outcome
    converted = work / f"{head_dir.name}.{format_name}.converted.gguf"
    error = llamacpp.convert(export_dir, Path(run.base_path), converted, work / f"{converted.name}.log")
    if error:
        outcome.status, outcome.error = "engine-error", error
        return outcome
    spec_type = LLAMACPP_CONVERTED[format_name]
    log = work / f"{head_dir.name}.{format_name}.llamacpp.log"
    decode_in_llamacpp(outcome, converted, spec_type, run, ours, chain, settings, log)
    return outcome


def converted_formats(kind: str, engines: tuple[str, ...]) -> list[str]:
    """The release formats of a ``kind`` head that llama.cpp drafts with after its converter."""
    from draftheads.export import formats_for

    if "llama.cpp" not in engines:
        return []
    return [name for name in formats_for(kind) if name in LLAMACPP_CONVERTED]


# ---- vLLM over HTTP -------------------------------------------------------------------------------

# Formats also served by ``vllm serve`` in the check, as users run it: the eagle3 export as the draft
# of the base, the speculators export as the model itself (its config names the verifier).
HTTP_FORMATS = ("eagle3", "speculators")


def http_server_settings(run: BaseRun, format_name: str, export_dir: Path, chain: int) -> dict:
    """``vllm_server``'s model, tokenizer and speculative config for one export."""
    request = vllm_request(run, format_name, export_dir, chain)
    return {
        "model": request.get("model") or run.base_path,
        "tokenizer": run.base_path if request.get("model") else None,
        "speculative_config": request["speculative_config"],
    }


def decode_over_http(run: BaseRun, served: dict, settings: CheckSettings, log: Path) -> dict:
    """Start ``vllm serve`` (``served``: http_server_settings), send each prompt as a one-turn chat
    through ``/v1/chat/completions``, read ``/metrics``; the server is stopped on success and on
    failure. ``{"error": ...}`` when it could not be started or answered."""
    import urllib.error

    from draftheads.serving import vllm

    extra = ("--enforce-eager",) if settings.enforce_eager else ()
    started = time.perf_counter()
    try:
        with vllm.vllm_server(
            VENVS / "vllm",
            served["model"],
            log,
            max_model_len=settings.max_model_len,
            speculative_config=served["speculative_config"],
            tokenizer=served["tokenizer"],
            extra_args=extra,
            timeout=settings.engine_timeout,
        ) as url:
            model = vllm.served_model(url)
            answers = [vllm.chat(url, model, p, settings.max_new_tokens) for p in settings.prompts]
            counts = vllm.spec_counts(vllm.get_text(url, "/metrics"))
    except (vllm.ServerError, urllib.error.URLError, OSError, KeyError, ValueError) as err:
        tail = log.read_text()[-2000:] if log.is_file() else ""
        return {"error": f"{type(err).__name__}: {err}\n{tail}"}
    return {"answers": answers, "spec_decode": counts, "seconds": round(time.perf_counter() - started, 1)}


def check_vllm_http(
    head_dir: Path,
    format_name: str,
    offline: Outcome,
    export_dir: Path,
    run: BaseRun,
    chain: int,
    settings,
    work,
) -> Outcome:
    """(d) ``vllm serve`` with the export: the prompt ids its chat template makes are ours, its greedy
    answers are the offline engine's (token ids and text), and so are its acceptance counts."""
    outcome = Outcome(offline.head, offline.kind, format_name, "vllm-http", status="pass")
    served = http_server_settings(run, format_name, export_dir, chain)
    result = decode_over_http(run, served, settings, work / f"{head_dir.name}.{format_name}.http.log")
    if "error" in result:
        outcome.status, outcome.error = "engine-error", result["error"]
        return outcome
    answers = result["answers"]
    expected = run.reference["outputs"]
    texts = [run.tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    engine_counts = result["spec_decode"] or {"drafts": 0, "accepted_per_position": []}
    offline_counts = offline.details.get("engine_acceptance") or {"drafts": -1, "accepted_per_position": []}
    outcome.checks = {
        "prompt_ids_equal_ours": [a["prompt_token_ids"] for a in answers] == run.request["prompts"],
        "output_equals_offline": first_difference(expected, [a["token_ids"] for a in answers]) is None,
        "text_equals_offline": [a["text"] for a in answers] == texts,
        "acceptance_equals_offline": acceptance_matches(offline_counts, engine_counts),
    }
    outcome.details = {
        "chain": chain,
        "engine_acceptance": engine_counts,
        "offline_acceptance": offline_counts,
        "first_difference": first_difference(expected, [a["token_ids"] for a in answers]),
        "finish_reasons": [a["finish_reason"] for a in answers],
        "engine_seconds": result["seconds"],
    }
    return outcome


def check_speculators(
    head_dir: Path, algorithm: str, exports: dict[str, Path], run: BaseRun, settings, work
) -> Outcome:
    """(c): speculators loads our speculators export of ``algorithm`` and converts our release-layout
    export (``SPECULATORS_PAIRS``) into it; a load-only algorithm (``SPECULATORS_LOAD_ONLY``) is
    loaded alone."""
    if algorithm in SPECULATORS_PAIRS:
        release_format, speculators_format = SPECULATORS_PAIRS[algorithm]
    else:
        release_format, speculators_format = None, SPECULATORS_LOAD_ONLY[algorithm]
    outcome = Outcome(head_dir.name, head_kind(head_dir), speculators_format, "speculators", status="pass")
    request = {
        "algorithm": algorithm,
        "speculators_export": str(exports[speculators_format]),
        "release_export": str(exports[release_format]) if release_format else None,
        "verifier": run.base_path,
        "work_dir": str(work / f"{head_dir.name}.{speculators_format}-convert"),
    }
    name = f"{head_dir.name}.{speculators_format}-package"
    result = run_engine(
        "speculators_check.py", "speculators", request, work, name, dict(os.environ), settings.engine_timeout
    )
    if "error" in result:
        outcome.status, outcome.error = "engine-error", result["error"]
        return outcome
    outcome.checks = speculators_checks(result)
    outcome.details = {k: v for k, v in result.items() if k in ("speculators_version", "load", "convert")}
    return outcome


def check_head(head_dir: Path, run: BaseRun, settings: CheckSettings, work: Path) -> list[Outcome]:
    """Every engine format that holds this head's kind, each checked in its engine."""
    from draftheads.heads import load_head

    formats = engine_formats(head_kind(head_dir), settings.engines)
    converted = converted_formats(head_kind(head_dir), settings.engines)
    head = load_head(head_dir, run.base_model)
    chain = engine_chain(head, settings.chain)
    ours = None
    if converted or any(name in VLLM_METHODS or name in LLAMACPP_FORMATS for name in formats):
        ours = decode_ours(
            run.base_model, run.tokenizer, head, run.request["prompts"], chain, settings.max_new_tokens
        )
    outcomes, exports = [], {}
    for format_name in formats:
        outcome, export_dir = check_format(head_dir, format_name, run, ours, chain, settings, work)
        outcomes.append(outcome)
        if export_dir is not None:
            exports[format_name] = export_dir
        if format_name in HTTP_FORMATS and outcome.status == "pass":
            outcomes.append(
                check_vllm_http(head_dir, format_name, outcome, export_dir, run, chain, settings, work)
            )
    for algorithm, pair in SPECULATORS_PAIRS.items():
        if set(pair) <= set(exports):
            outcomes.append(check_speculators(head_dir, algorithm, exports, run, settings, work))
    if SPECULATORS_LOAD_ONLY.get(head.kind) in exports:
        outcomes.append(check_speculators(head_dir, head.kind, exports, run, settings, work))
    for format_name in converted:
        outcomes.append(check_llamacpp_converted(head_dir, format_name, run, ours, chain, settings, work))
    return outcomes


def check_base(base_name: str, head_dirs: list[Path], settings: CheckSettings, work: Path) -> list[Outcome]:
    """The shipped heads on one base, plus fresh heads of the kinds none of them has."""
    from draftheads.base_model import load_base, resolve_base_path

    base_model, tokenizer = load_base(base_name, dtype="float32")
    shipped_kinds = {head_kind(d) for d in head_dirs}
    missing = [k for k in UNTRAINED_HEADS if k not in shipped_kinds and engine_formats(k, settings.engines)]
    head_dirs = head_dirs + untrained_heads(base_model, base_name, missing, work)
    request = {
        "base": resolve_base_path(base_name),
        "dtype": "float32",
        "prompts": prompt_ids(tokenizer, settings.prompts),
        "max_new_tokens": settings.max_new_tokens,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
    }
    env = vllm_environment()
    reference = {}
    if "vllm" in settings.engines:
        without_draft = {**request, "speculative_config": None}
        name = "vllm-without-draft"
        reference = run_engine(
            "vllm_decode.py", "vllm", without_draft, work, name, env, settings.engine_timeout
        )
    llamacpp_run = {}
    if any(
        name in LLAMACPP_FORMATS or name in LLAMACPP_CONVERTED
        for d in head_dirs
        for name in engine_formats(head_kind(d), settings.engines)
        + converted_formats(head_kind(d), settings.engines)
    ):
        llamacpp_run = llamacpp_base(base_name, request["prompts"], settings, work)
    run = BaseRun(base_model, tokenizer, request["base"], request, reference, env, llamacpp_run)
    outcomes = []
    for head_dir in head_dirs:
        outcomes += check_head(head_dir, run, settings, work)
    for outcome in outcomes:
        if outcome.status == "pass" and not all(outcome.checks.values()):
            outcome.status = "fail"
    return outcomes


def uncovered_formats(outcomes: list[Outcome], engines: tuple[str, ...] = ENGINE_NAMES) -> list[Outcome]:
    """A row for each engine format no checked head reached (a new head kind without a shipped head
    nor an entry in ``UNTRAINED_HEADS``), so that nothing goes unreported."""
    from draftheads.export import FORMAT_REGISTRY

    reached = {o.format for o in outcomes}
    return [
        Outcome(
            "-",
            "/".join(chosen.head_kinds),
            name,
            "-",
            "no-head",
            error=f"no head of kind {' or '.join(chosen.head_kinds)}: none shipped, none in UNTRAINED_HEADS",
        )
        for name, chosen in FORMAT_REGISTRY.items()
        if name != "draftheads" and name not in reached and format_selected(name, engines)
    ]


# ---- report -------------------------------------------------------------------------------------


def machine() -> dict:
    import platform

    from draftheads.machine import cpu_flags, cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
    }


def counts_cell(counts: dict | None) -> str:
    return f"{counts['drafts']}: {counts['accepted_per_position']}" if counts else "-"


def report_markdown(report: dict) -> str:
    """The report as a markdown page: one row per (head, format, engine), then the errors."""
    settings, host = report["settings"], report["machine"]
    lines = [
        "# Exports in real engines",
        "",
        (
            f"`engines/check.py`: {len(settings['prompts'])} prompts x {settings['max_new_tokens']} new "
            f"tokens, greedy, fp32, a chain of {settings['chain']} draft tokens (a DFlash head: its "
            f"block_size - 1); {report['seconds']} s."
        ),
        f"Machine: {host['cpu']}, {host['cores']} cores, flags {' '.join(host['cpu_flags'])}.",
        "",
        "| head | format | engine | status | checks | engine: drafts, accepted per position | ours |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in report["outcomes"]:
        checks = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in o["checks"].items()) or "-"
        engine_counts = counts_cell(o["details"].get("engine_acceptance"))
        our_counts = counts_cell(o["details"].get("our_acceptance"))
        lines.append(
            f"| {o['head']} | {o['format']} | {o['engine']} | {o['status']} | {checks} "
            f"| {engine_counts} | {our_counts} |"
        )
    errors = [o for o in report["outcomes"] if o["error"]]
    if errors:
        lines += ["", "## Not run, refused or failed, in the engine's own words", ""]
        for o in errors:
            last_line = o["error"].strip().splitlines()[-1][:400]
            lines.append(f"- {o['head']} / {o['format']} ({o['engine']}, {o['status']}): `{last_line}`")
    return "\n".join(lines) + "\n"


def write_report(outcomes: list[Outcome], settings: CheckSettings, seconds: float) -> None:
    settings.out.mkdir(parents=True, exist_ok=True)
    chosen = asdict(settings)
    chosen.pop("out")
    report = {
        "machine": machine(),
        "settings": chosen,
        "seconds": round(seconds, 1),
        "outcomes": [asdict(o) for o in outcomes],
    }
    (settings.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (settings.out / "report.md").write_text(report_markdown(report))


def main(argv: list[str] | None = None) -> int:
    defaults = CheckSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--heads", nargs="+", default=list(defaults.heads), help="shipped heads' names or head directories"
    )
    parser.add_argument("--out", type=Path, default=defaults.out, help="where report.json / report.md go")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--chain", type=int, default=defaults.chain, help="draft tokens per step")
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINE_NAMES, default=list(defaults.engines), help="engines to check"
    )
    args = parser.parse_args(argv)
    settings = CheckSettings(
        heads=tuple(args.heads),
        out=args.out,
        max_new_tokens=args.max_new_tokens,
        chain=args.chain,
        engines=tuple(args.engines),
    )
    from draftheads.heads import resolve_base_model

    by_base: dict[str, list[Path]] = {}
    for head_dir in resolve_heads(settings.heads):
        by_base.setdefault(resolve_base_model(head_dir), []).append(head_dir)
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="engine-check-") as work:
        for base_name, head_dirs in by_base.items():
            outcomes += check_base(base_name, head_dirs, settings, Path(work))
    outcomes += uncovered_formats(outcomes, settings.engines)
    outcomes += unserved_outcomes(settings.heads)
    write_report(outcomes, settings, time.perf_counter() - started)
    print((settings.out / "report.md").read_text())
    failed = [o for o in outcomes if o.status in FAILING]
    passed = [o for o in outcomes if o.status == "pass"]
    print(f"engines: {len(passed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
