"""``draftheads tune-tree``: pick the draft tree that maximises expected tokens/s on this machine."""

from __future__ import annotations

import argparse
import time

from draftheads.arguments import (
    add_draft_dtype_argument,
    add_pack_argument,
    add_tuning_prompt_arguments,
    at_least,
    device_name,
    dtype_name,
    positive_int,
)
from draftheads.tuning.tune import TuneSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TuneSettings()
    add_tuning_prompt_arguments(parser, defaults, "tuned tree")
    parser.add_argument("--top-k", type=positive_int, default=defaults.top_k, help="ranks measured per depth")
    parser.add_argument(
        "--max-depth", type=positive_int, default=defaults.max_depth, help="depths measured (EAGLE)"
    )
    parser.add_argument(
        "--max-nodes", type=at_least(2), default=defaults.max_nodes, help="largest tree (root included)"
    )
    parser.add_argument("--prefix-tokens", type=positive_int, default=defaults.prefix_tokens)
    parser.add_argument("--repeats", type=positive_int, default=defaults.repeats)
    parser.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="*",
        default=list(defaults.batch_sizes),
        help="batch sizes whose verify cost is measured too (for batch decoding); none: skip",
    )
    parser.add_argument(
        "--dtype", type=dtype_name, default=defaults.dtype, help="float32 | bfloat16 (costs differ by dtype)"
    )
    parser.add_argument("--device", type=device_name, default=defaults.device)
    add_draft_dtype_argument(parser)
    add_pack_argument(parser)


def settings_from_args(args: argparse.Namespace) -> TuneSettings:
    return TuneSettings(
        data=args.data,
        template=args.template,
        skip=args.skip,
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        top_k=args.top_k,
        max_depth=args.max_depth,
        max_nodes=args.max_nodes,
        prefix_tokens=args.prefix_tokens,
        repeats=args.repeats,
        batch_sizes=tuple(args.batch_sizes),
        dtype=args.dtype,
        device=args.device,
        draft_dtype=args.draft_dtype,
    )


def run(args: argparse.Namespace) -> int:
    from draftheads.base_model import load_base, resolve_dtype
    from draftheads.device import check_device
    from draftheads.heads import load_head_and_base, resolve_base_model
    from draftheads.heads.base import resolve_head_dir
    from draftheads.infer.kernel_choice import choose_kernels, prepare_drafting_head
    from draftheads.infer.tree import read_tuned_entry
    from draftheads.tuning.report import describe
    from draftheads.tuning.tune import tune_tree

    settings = settings_from_args(args)
    # A broken head directory or tree.json (HeadFormatError) and an unusable device (DeviceError)
    # end the command as one line with the exit status of their kind, in draftheads.cli.main.
    check_device(settings.device)
    head_dir = resolve_head_dir(args.heads)  # a training run's output directory: its head/
    base = resolve_base_model(head_dir, args.base)
    # the tree.json the result is merged into: a broken one is refused now, not after tuning
    read_tuned_entry(head_dir, resolve_dtype(settings.dtype, settings.device), settings.device)
    model, tokenizer = load_base(base, dtype=settings.dtype, device=settings.device)
    head, model = load_head_and_base(head_dir, model, map_location=settings.device)
    # tune on the kernels generate and bench decode with (chosen for this machine: --pack), and time
    # the drafting the head will do (in its drafting dtype)
    kernels = choose_kernels(model, args.pack)
    prepare_drafting_head(head, model, kernels, settings.draft_dtype)
    print(f"linear kernels: {kernels.describe()}")
    started = time.perf_counter()
    record = tune_tree(model, head, tokenizer, head_dir, settings)
    print(describe(record))
    print(f"tuned in {time.perf_counter() - started:.0f} s; wrote " + ", ".join(record["paths"]))
    return 0
