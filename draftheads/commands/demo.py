"""``draftheads demo`` (``make demo``): the main job end to end on the embedded defaults
(``draftheads.demo``)."""

from __future__ import annotations

import argparse
import dataclasses

from draftheads.arguments import positive_int
from draftheads.demo import DemoSettings, run_demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoSettings()
    parser.add_argument("--out", default=defaults.out_dir, help="demo directory (reused on a re-run)")
    parser.add_argument("--base", default=defaults.base)
    parser.add_argument(
        "--conversations", type=positive_int, default=defaults.conversations, help="conversations to distill"
    )
    parser.add_argument("--train-steps", type=positive_int, default=defaults.train_steps)
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens)
    parser.add_argument("--question", default=defaults.question_id, help="MT-bench question id")
    parser.add_argument("--no-tune", action="store_true", help="skip tree tuning (use the default tree)")


def run(args: argparse.Namespace) -> int:
    settings = dataclasses.replace(
        DemoSettings(),
        out_dir=args.out,
        base=args.base,
        conversations=args.conversations,
        train_steps=args.train_steps,
        max_new_tokens=args.max_new_tokens,
        question_id=args.question,
        tune=not args.no_tune,
    )
    run_demo(settings)
    return 0
