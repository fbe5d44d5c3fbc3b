"""``draftheads plan``: a training step's memory per GPU, term by term, before a run.

From the run config and the base's config.json alone (no weights): the terms of
``draftheads.plan``, their total, the largest micro-batch that fits the GPU's memory and the
feature cache's size a token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from draftheads.arguments import positive_int

DEFAULT_GPUS = 8
DEFAULT_GPU_MEMORY_GIB = 80.0
HEADROOM = 0.9  # of the GPU's memory a plan may fill (the CUDA context, the allocator's slack)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=4096")
    parser.add_argument(
        "--base-config",
        type=Path,
        default=None,
        help="the base's config.json (default: model.base's, from its directory or the Hub)",
    )
    parser.add_argument(
        "--gpus", type=positive_int, default=DEFAULT_GPUS, help=f"data-parallel GPUs ({DEFAULT_GPUS})"
    )
    parser.add_argument(
        "--gpu-memory", type=float, default=DEFAULT_GPU_MEMORY_GIB, help="GiB of memory a GPU has (80)"
    )
    parser.add_argument(
        "--tokens", type=positive_int, default=None, help="tokens a row (default data.max_length)"
    )
    parser.add_argument(
        "--target",
        choices=("cuda", "cpu"),
        default="cuda",
        help="what the run trains on (cpu: to check a plan against a CPU run; its AdamW needs temporaries)",
    )


def base_config_of(run, path: Path | None):
    """The base's config: ``path`` (a config.json or a model directory), else model.base's."""
    from transformers import AutoConfig

    from draftheads.base_model import resolve_base_path

    if path is None:
        return AutoConfig.from_pretrained(resolve_base_path(run.model.base))
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    import json

    from draftheads.settings import ConfigError

    try:
        fields = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"--base-config {path}: not a readable config.json ({err})") from err
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(f"--base-config {path}: no model_type field; give a model's config.json")
    return AutoConfig.for_model(**fields)


def run(args: argparse.Namespace) -> int:
    from draftheads.config import load_run_config
    from draftheads.plan import GIB, cache_bytes_per_token, count_shapes, largest_micro_batch, plan_step
    from draftheads.settings import ConfigError

    run_config = load_run_config(args.config, args.overrides)
    if run_config.head is None:
        raise ConfigError(f"{args.config}: no head section to plan for")
    shapes = count_shapes(run_config, base_config_of(run_config, args.base_config))
    plan = plan_step(run_config, shapes, args.gpus, tokens=args.tokens, device=args.target)
    budget = args.gpu_memory * GIB * HEADROOM
    print(
        f"{run_config.head.kind} on {run_config.model.base}: micro-batch {plan.micro_batch} x {plan.tokens} "
        f"tokens, ZeRO-{plan.stage}, {args.gpus} GPU(s)\n"
    )
    print(plan.table())
    fits = largest_micro_batch(run_config, shapes, args.gpus, budget, tokens=args.tokens, device=args.target)
    verdict = "fits" if plan.total <= budget else "does NOT fit"
    print(f"\n{verdict} {HEADROOM:.0%} of {args.gpu_memory:g} GiB; the largest micro-batch that fits: {fits}")
    per_token = cache_bytes_per_token(shapes)
    print(f"feature cache: {per_token:,} bytes a token ({per_token * 1e9 / 1e12:.1f} TB per billion tokens)")
    return 0
