"""Argument types shared by the subcommands: argparse rejects a bad number before any work starts,
with the usual ``draftheads CMD: error: argument --x: ...`` message and exit status 2."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse ``type`` for integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its own messages
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def add_no_pack_argument(parser: argparse.ArgumentParser) -> None:
    """``--no-pack``: keep PyTorch's default linear kernels (``draftheads.infer.packed`` is used by
    default where it applies: fp32 on an x86 CPU)."""
    parser.add_argument(
        "--no-pack",
        action="store_true",
        help="do not prepack fp32 linear weights for oneDNN on CPU (default: pack where supported)",
    )
