"""The ``draftheads`` command: one thin entry point over the subcommands.

Each subcommand is a module of ``draftheads.commands`` exposing ``add_arguments(parser)`` and
``run(args) -> int`` over the library code it drives; only the chosen subcommand's module is
imported, so ``draftheads generate`` never pays for deepspeed or datasets. Errors are handled here
once for every command: a user error is one line on stderr and its kind's exit status, a bug a
traceback (``main``; the statuses are in docs/cli-exit-codes.md).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
import traceback
from dataclasses import dataclass

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
    "plan": ("draftheads.commands.plan", "a training step's memory per GPU, planned before a run"),
    "generate": ("draftheads.commands.generate", "decode with a draft head (lossless speculative decoding)"),
    "export": ("draftheads.commands.export", "export a head for the Hub, vLLM or SGLang"),
    "bench": ("draftheads.commands.bench", "benchmark heads against plain and prompt-lookup decoding"),
    "tune-tree": (
        "draftheads.commands.tune_tree",
        "pick the draft tree that maximises tokens/s on this machine",
    ),
    "fit-confidence": (
        "draftheads.commands.fit_confidence",
        "fit the acceptance head adaptive drafting can price draft nodes with",
    ),
    "demo": ("draftheads.commands.demo", "the end-to-end demo on the embedded defaults"),
}


# Exit statuses, one per kind of error, the same for every command (docs/cli-exit-codes.md).
EXIT_OK = 0
EXIT_OTHER = 1  # a user error of no kind below (an OSError not named in any)
EXIT_USAGE = 2  # how the command was called: argparse's own status, an unknown command, a bad option
EXIT_BAD_INPUT = 3
EXIT_HEAD = 4
EXIT_ENVIRONMENT = 5
EXIT_REFUSED = 6
EXIT_BUG = 70  # sysexits.h EX_SOFTWARE: an internal error, shown with its traceback
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


@dataclass(frozen=True)
class ErrorKind:
    """A kind of user error: its exit status and the base classes, as (module, class), whose
    instances (subclasses included) are of it. A module not yet imported cannot have raised its
    error, so matching checks only loaded modules and imports nothing."""

    status: int
    name: str
    classes: tuple[tuple[str, str], ...]
    errnos: tuple[str, ...] = ()  # OSError errno names that are of this kind, whatever the class


# In order: an error is of the first kind that claims it (a refusal to overwrite is an OSError and
# may be a ConfigError too; a full disk is an OSError of any class).
ERROR_KINDS: tuple[ErrorKind, ...] = (
    ErrorKind(
        EXIT_REFUSED,
        "refused: would overwrite or write into what it must not",
        (("builtins", "FileExistsError"), ("draftheads.train.lock", "OutputDirLockedError")),
    ),
    ErrorKind(
        EXIT_HEAD,
        "head or checkpoint files",
        (
            ("draftheads.heads.base", "HeadFormatError"),  # export's FormatError is one
            ("draftheads.heads.base", "HeadMismatchError"),
            ("draftheads.train.checkpoint", "CorruptCheckpointError"),
            ("safetensors", "SafetensorError"),
        ),
    ),
    ErrorKind(
        EXIT_ENVIRONMENT,
        "environment: a missing dependency, device, disk space, network service",
        (
            ("draftheads.optional", "MissingDependencyError"),
            ("draftheads.base_model", "BaseModelError"),
            ("draftheads.device", "DeviceError"),
            ("draftheads.storage", "InsufficientSpaceError"),
            ("draftheads.export.hub", "HubError"),
            ("draftheads.serving.vllm", "ServerError"),
        ),
        errnos=("ENOSPC", "EDQUOT", "EACCES", "EPERM", "EROFS"),
    ),
    ErrorKind(
        EXIT_BAD_INPUT,
        "bad input: config, data, prompts, settings, paths",
        (
            ("draftheads.settings", "ConfigError"),
            ("draftheads.data.sources", "DataError"),
            ("draftheads.prompt_format", "TemplateError"),
            ("draftheads.data.shard_file", "ShardFileError"),
            ("draftheads.data.shard_file", "MissingTensorError"),
            ("draftheads.prompts_file", "PromptsFileError"),
            ("draftheads.infer.inputs", "PromptError"),
            ("draftheads.infer.limits", "TreeFitError"),
            ("draftheads.infer.precision", "DraftDtypeError"),
            ("draftheads.bench", "BenchError"),
            ("builtins", "FileNotFoundError"),
            ("builtins", "IsADirectoryError"),
            ("builtins", "NotADirectoryError"),
        ),
    ),
    ErrorKind(EXIT_OTHER, "any other user error", (("builtins", "OSError"),)),
)
DEBUG_FLAG = "--debug"
# The rank flag launchers add to the script's arguments: DeepSpeed's launcher puts
# ``--local_rank=N`` straight after the script, before our command (deepspeed/launcher/launch.py);
# ``torch.distributed.launch`` wrote ``--local-rank=N``. Both also set LOCAL_RANK.
LAUNCHER_RANK_FLAGS = ("--local_rank", "--local-rank")
DEBUG_ENV = "DRAFTHEADS_DEBUG"  # set to 1 for the same as --debug
# What to do about an OSError that says only what the system said.
OS_ERROR_HINTS = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EACCES: "check the permissions, or write elsewhere",
    errno.EPERM: "check the permissions, or write elsewhere",
    errno.EROFS: "the filesystem is read-only: write elsewhere",
}


def _claims(kind: ErrorKind, err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in {getattr(errno, name) for name in kind.errnos}:
        return True
    loaded = (getattr(sys.modules.get(module), name, None) for module, name in kind.classes)
    return any(isinstance(err, cls) for cls in loaded if isinstance(cls, type))


def exit_status(err: BaseException) -> int:
    """The exit status for ``err``: its kind's (``ERROR_KINDS``), or EXIT_BUG for anything else."""
    return next((kind.status for kind in ERROR_KINDS if _claims(kind, err)), EXIT_BUG)


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


def take_launcher_rank(argv: list[str]) -> None:
    """Remove a launcher's ``--local_rank=N`` / ``--local-rank N`` from ``argv`` wherever it stands
    (it belongs to no command) and export it as LOCAL_RANK unless the launcher set that already."""
    index = 0
    while index < len(argv):
        flag, equals, value = argv[index].partition("=")
        if flag not in LAUNCHER_RANK_FLAGS:
            index += 1
            continue
        if not equals and index + 1 < len(argv) and argv[index + 1].isdigit():
            value = argv.pop(index + 1)
        argv.pop(index)
        if value.isdigit():
            os.environ.setdefault("LOCAL_RANK", value)


def run_command(name: str, argv: list[str]) -> int:
    module_name, description = COMMANDS[name]
    module = importlib.import_module(module_name)
    command_parser = argparse.ArgumentParser(prog=f"draftheads {name}", description=description)
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv)
    return int(module.run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user error ends it as one line on stderr, ``draftheads <command>:
    <message>``, with its kind's exit status (``ERROR_KINDS``); any other exception is a bug: its
    traceback, a line asking to report it, status 70. ``--debug`` (before the command) or
    DRAFTHEADS_DEBUG=1 lets every error propagate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    take_launcher_rank(argv)
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
            return EXIT_USAGE
        parser.print_help()
        return EXIT_OK
    name = argv[0]
    try:
        return run_command(name, argv[1:])
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"draftheads {name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if debug:
            raise
        status = exit_status(err)
        if status != EXIT_BUG:
            print(f"draftheads {name}: {describe(err)}", file=sys.stderr)
            return status
        traceback.print_exc()
        print(
            f"draftheads {name}: internal error ({type(err).__name__}); this is a bug in draftheads, "
            "please report it with the command line and the traceback above",
            file=sys.stderr,
        )
        return EXIT_BUG


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
