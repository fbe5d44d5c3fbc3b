"""``draftheads fit-confidence``: fit the acceptance head adaptive drafting can price nodes with."""

from __future__ import annotations

import argparse
import time

from draftheads.arguments import (
    add_pack_argument,
    add_tuning_prompt_arguments,
    device_name,
    dtype_name,
    non_negative_int,
    positive_int,
    probability,
)
from draftheads.tuning.confidence import ConfidenceSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ConfidenceSettings()
    add_tuning_prompt_arguments(parser, defaults, "confidence head")
    parser.add_argument(
        "--held-out",
        type=probability,
        default=defaults.held_out,
        help="share of the prompts scored, not fitted",
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=defaults.hidden, help="the head's hidden width"
    )
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="optimiser steps")
    parser.add_argument("--seed", type=non_negative_int, default=defaults.seed)
    parser.add_argument("--dtype", type=dtype_name, default=defaults.dtype, help="float32 | bfloat16")
    parser.add_argument("--device", type=device_name, default=defaults.device)
    add_pack_argument(parser)


def settings_from_args(args: argparse.Namespace) -> ConfidenceSettings:
    return ConfidenceSettings(
        data=args.data,
        template=args.template,
        skip=args.skip,
        prompts=args.prompts,
        held_out=args.held_out,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        hidden=args.hidden,
        steps=args.steps,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    from draftheads.heads.base import resolve_head_dir
    from draftheads.infer import SpeculativeGenerator
    from draftheads.infer.confidence import check_confidence_space
    from draftheads.tuning.confidence import describe, fit_head_confidence

    settings = settings_from_args(args)
    head_dir = resolve_head_dir(args.heads)  # a training run's output directory: its head/
    check_confidence_space(head_dir, settings.hidden)  # a full disk: before minutes of decoding
    # the trees adaptive drafting prunes: the head's tuned tree with context drafts, unpruned here
    generator = SpeculativeGenerator.from_pretrained(
        head_dir, args.base, dtype=settings.dtype, device=settings.device, pack=args.pack, adaptive=False
    )
    print(f"decoding with {generator.method}; linear kernels: {generator.kernels}")
    started = time.perf_counter()
    _, record = fit_head_confidence(generator, generator.tokenizer, head_dir, settings)
    print(describe(record))
    print(f"fitted in {time.perf_counter() - started:.0f} s; wrote " + ", ".join(record["paths"]))
    return 0
