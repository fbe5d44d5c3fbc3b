"""The ``draftheads`` command: one thin entry point over the subcommands.

Each subcommand is a module of ``draftheads.commands`` exposing ``add_arguments(parser)`` and
``run(args) -> int`` over the library code it drives; only the chosen subcommand's module is
imported, so ``draftheads generate`` never pays for deepspeed or datasets.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("draftheads.commands.data", "inspect a data pipeline: conversations, tokens, masks"),
    "distill": ("draftheads.commands.distill", "regenerate assistant turns with the base model"),
    "train": ("draftheads.commands.train", "train a draft head on a frozen base model"),
    "cache-features": ("draftheads.commands.cache_features", "cache base hidden states for offline training"),
    "generate": ("draftheads.commands.generate", "decode with a draft head (lossless speculative decoding)"),
    "export": ("draftheads.commands.export", "export a head for the Hub, vLLM or SGLang"),
    "bench": ("draftheads.commands.bench", "benchmark heads against plain and prompt-lookup decoding"),
    "tune-tree": (
        "draftheads.commands.tune_tree",
        "pick the draft tree that maximises tokens/s on this machine",
    ),
    "demo": ("draftheads.commands.demo", "the end-to-end demo on the embedded defaults"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="draftheads", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(
                f"draftheads: unknown command '{argv[0]}'; choose from {', '.join(COMMANDS)}", file=sys.stderr
            )
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    command_parser = argparse.ArgumentParser(prog=f"draftheads {name}", description=description)
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
