"""``draftheads export``: turn a trained head into a Hub-ready checkpoint or an engine's format.

    draftheads export --heads runs/eagle3/head --format eagle3 --out exports/eagle3 \\
        [--push-to-hub user/my-eagle3-head [--private]]

Formats (``draftheads.export.FORMAT_REGISTRY``): ``draftheads`` (default; config.json +
model.safetensors + README.md model card, loadable with ``load_head``), ``eagle3``, ``speculators``,
``eagle``, ``eagle-sglang``, ``medusa-vllm``, ``mtp-deepseek``, ``dflash``,
``dflash-speculators``, ``gguf`` (llama.cpp). A format that cannot hold the head is
refused with the list of formats that can. Tensors go to safetensors (gguf: GGUF). docs/export.md shows how
each output is served in vLLM and SGLang.

Every export lists its files in ``draftheads-export.json``; ``--overwrite`` replaces such a
directory and nothing else, and the new export is renamed into place only once complete.
"""

from __future__ import annotations

import argparse
import sys

from draftheads.arguments import positive_int
from draftheads.export import (
    DEFAULT_FORMAT,
    FORMAT_REGISTRY,
    ExportOptions,
    export_head,
    push_to_hub,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--heads",
        required=True,
        help="head directory (draftheads or an engine format), or a training run's output directory",
    )
    parser.add_argument(
        "--format", default=DEFAULT_FORMAT, choices=list(FORMAT_REGISTRY), help="output layout"
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--base",
        default=None,
        help="base model, when the format stores base tensors (default: the one the head names)",
    )
    parser.add_argument(
        "--verifier",
        default=ExportOptions.verifier,
        help="speculators: verifier name engines resolve (default: the head's base name)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=positive_int,
        default=ExportOptions.speculative_tokens,
        help=(
            "speculators: draft tokens vLLM proposes a step with an EAGLE-3 head (default 3); a P-EAGLE "
            "or DFlash head records its trained depth, and another number is refused"
        ),
    )
    parser.add_argument(
        "--target-gguf",
        default=ExportOptions.target_gguf,
        help="gguf: the base's GGUF llama.cpp verifies with (default: an embedded base's own GGUF)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous export in --out (recognised by its manifest; nothing else is replaced)",
    )
    parser.add_argument(
        "--push-to-hub", metavar="REPO_ID", default=None, help="upload the result to this Hub repository"
    )
    parser.add_argument(
        "--private", action="store_true", help="with --push-to-hub: create the repository private"
    )


def run(args: argparse.Namespace) -> int:
    if args.private and not args.push_to_hub:
        print("draftheads export: --private needs --push-to-hub", file=sys.stderr)
        return 2
    options = ExportOptions(
        speculative_tokens=args.speculative_tokens, verifier=args.verifier, target_gguf=args.target_gguf
    )
    # Errors (a refused --out, a format that cannot hold the head, a full disk, the Hub) end the
    # command as one line on stderr, in draftheads.cli.main.
    files = export_head(args.heads, args.out, args.format, args.base, options, args.overwrite)
    print(
        f"wrote {args.format} export to {args.out}: {', '.join(str(p.relative_to(args.out)) for p in files)}"
    )
    if args.push_to_hub:
        print(push_to_hub(args.out, args.push_to_hub, private=args.private))
    return 0
