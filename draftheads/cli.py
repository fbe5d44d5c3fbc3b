"""The ``draftheads`` command: one thin entry point over the subcommands.

Each subcommand is a module of ``draftheads.commands`` exposing ``add_arguments(parser)`` and
``run(args) -> int`` over the library code it drives; only the chosen subcommand's module is
imported, so ``draftheads generate`` never pays for deepspeed or datasets. Errors are handled here
once for every command: a user error is one line on stderr, a bug a traceback (``main``).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
import traceback

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("draftheads.commands.data", "inspect a data pipeline: conversations, tokens, masks"),
    "synth-prompts": (
        "draftheads.commands.synth_prompts",
        "sample user prompts from the base model's chat template (Magpie)",
    ),
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


# The project's user-error types, as (module, class): bad input, missing or unreadable files, config
# and format errors. A module not yet imported cannot have raised its error, so the handler checks
# only the loaded ones and imports nothing. Every OSError (a missing file, permission denied, a
# read-only filesystem, a full disk) is a user error too.
USER_ERRORS: tuple[tuple[str, str], ...] = (
    ("draftheads.settings", "ConfigError"),
    ("draftheads.data.sources", "DataError"),
    ("draftheads.data.template", "TemplateError"),
    ("draftheads.heads.base", "HeadFormatError"),  # export's FormatError is one
    ("draftheads.heads.base", "HeadMismatchError"),
    ("draftheads.export.hub", "HubError"),
    ("draftheads.base_model", "BaseModelError"),
    ("draftheads.bench", "BenchError"),
    ("draftheads.infer.precision", "DraftDtypeError"),
    ("draftheads.optional", "MissingDependencyError"),
    ("safetensors", "SafetensorError"),
)
DEBUG_FLAG = "--debug"
DEBUG_ENV = "DRAFTHEADS_DEBUG"  # set to 1 for the same as --debug
# What to do about an OSError that says only what the system said.
OS_ERROR_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EACCES: "check the permissions, or write elsewhere",
    errno.EPERM: "check the permissions, or write elsewhere",
    errno.EROFS: "the filesystem is read-only: write elsewhere",
}


def is_user_error(err: BaseException) -> bool:
    """Is ``err`` the user's to fix (``USER_ERRORS``, any OSError) rather than a bug?"""
    if isinstance(err, OSError):
        return True
    loaded = (getattr(sys.modules.get(module), name, None) for module, name in USER_ERRORS)
    return any(isinstance(err, cls) for cls in loaded if isinstance(cls, type))


def describe(err: BaseException) -> str:
    """``err`` as one line: an OSError as ``file: reason; what to do``, anything else as its message."""
    if isinstance(err, OSError) and type(err).__str__ is OSError.__str__ and err.strerror:
        files = [str(name) for name in (err.filename, err.filename2) if name is not None]
        text = (" -> ".join(files) + ": " if files else "") + err.strerror
        if err.errno in OS_ERROR_HINTS:
            text += f"; {OS_ERROR_HINTS[err.errno]}"
    else:
        text = str(err) or type(err).__name__
    return re.sub(r"\s*\n\s*", " ", text.strip())


def debug_requested(argv: list[str]) -> bool:
    """Strip leading ``--debug`` flags from ``argv``; True if one was there or DRAFTHEADS_DEBUG is set."""
    flagged = False
    while argv and argv[0] == DEBUG_FLAG:
        argv.pop(0)
        flagged = True
    return flagged or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")


def run_command(name: str, argv: list[str]) -> int:
    module_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    command_parser = argparse.ArgumentParser(prog=f"draftheads {name}", description=description)
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv)
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user error ends it as one line on stderr, ``draftheads <command>:
    <message>``, exit status 1; any other exception is a bug: its traceback and a line asking to
    report it. ``--debug`` (before the command) or DRAFTHEADS_DEBUG=1 lets every error propagate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    parser = argparse.ArgumentParser(prog="draftheads", description=__doc__.splitlines()[0])
    parser.add_argument(DEBUG_FLAG, action="store_true", help=f"show tracebacks of errors (or {DEBUG_ENV}=1)")
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
    try:
        return run_command(name, argv[1:])
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"draftheads {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if debug:
            raise
        if is_user_error(err):
            print(f"draftheads {name}: {describe(err)}", file=sys.stderr)
            return 1
        traceback.print_exc()
        print(
            f"draftheads {name}: internal error ({type(err).__name__}); this is a bug in draftheads, "
            "please report it with the command line and the traceback above",
            file=sys.stderr,
        )
        return 1


def console_main() -> None:
    """The ``draftheads`` console script: ``main``, then leave the process group a command joined
    (``draftheads train``, ``cache-features``), so that no rank aborts as it exits; also when an
    error propagates out of ``main`` (``--debug``)."""
    code = 1  # the status if an exception leaves main
    try:
        code = main()
    finally:
        code = _leave_process_group(code)
    sys.exit(code)


def _leave_process_group(code: int) -> int:
    """``draftheads.distributed.leave_process_group`` after a command that ended with ``code``;
    returns the exit status: ``code``, or 1 where a successful rank found another one gone."""
    if "torch" not in sys.modules:  # no command joined a group without torch; checking must not import it
        return code
    from draftheads.distributed import leave_process_group

    try:
        leave_process_group(finished=code == 0)
    except RuntimeError as err:  # a rank failed before the end: the barrier's connection broke
        message = f"another process of this run failed before the end ({describe(err)})"
        print(f"draftheads: {message}", file=sys.stderr)
        return code or 1
    return code


if __name__ == "__main__":
    console_main()
