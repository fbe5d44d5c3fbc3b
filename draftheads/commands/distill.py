"""``draftheads distill``: regenerate the assistant turns of a conversation set with the base model,
so a head learns the base model's own text (``draftheads.data.distill``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from draftheads.arguments import positive_int
from draftheads.config import DataConfig, DistillConfig, ModelConfig
from draftheads.data.distill import distill
from draftheads.data.sources import read_conversations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model, data, config = ModelConfig(), DataConfig(), DistillConfig()
    parser.add_argument("--base", default=model.base, help="base model: Hub id, directory, .gguf or alias")
    parser.add_argument(
        "--data",
        default=data.source,
        help="conversations: sharegpt, a .json/.jsonl/.parquet file, or a dataset",
    )
    parser.add_argument("--split", default=data.split, help="split name for datasets")
    parser.add_argument(
        "--limit", type=positive_int, default=data.limit, help="regenerate the first N usable conversations"
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="output JSONL (ShareGPT form); appended to, resumable"
    )
    parser.add_argument("--temperature", type=float, default=config.temperature, help="0: greedy")
    parser.add_argument("--max-new-tokens", type=positive_int, default=config.max_new_tokens)
    parser.add_argument("--batch-size", type=positive_int, default=config.batch_size)
    parser.add_argument(
        "--max-length",
        type=int,
        default=data.max_length,
        help="stop a conversation where its prompt reaches this",
    )
    parser.add_argument("--dtype", default=model.dtype)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")


def run(args: argparse.Namespace) -> int:
    import torch

    from draftheads.base_model import load_base

    if args.batch_size < 1 or args.max_new_tokens < 1 or args.temperature < 0:
        raise SystemExit("distill: --batch-size and --max-new-tokens must be >= 1 and --temperature >= 0")
    start = time.perf_counter()
    conversations, report = read_conversations(args.data, args.split, args.limit)
    print(
        f"[distill] {report.conversations} conversations from {report.source} "
        f"(dropped: {report.dropped or 'none'})"
    )
    torch.manual_seed(args.seed)
    model, tokenizer = load_base(args.base, dtype=args.dtype, device=args.device)
    config = DistillConfig(
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size
    )
    counts = distill(model, tokenizer, conversations, args.out, config, max_length=args.max_length)
    print(
        f"[distill] wrote {counts['written']} conversations to {args.out} "
        f"({counts['skipped_existing']} already there, {counts['cut_at_length']} stopped at --max-length) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0
