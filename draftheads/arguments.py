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


def non_negative_float(text: str) -> float:
    """An argparse ``type`` for floats >= 0 (a temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


non_negative_float.__name__ = "number >= 0"


def non_empty_text(text: str) -> str:
    """An argparse ``type`` for a string that must not be empty (``--stop``)."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


non_empty_text.__name__ = "non-empty text"


def probability(text: str) -> float:
    """An argparse ``type`` for a probability mass in (0, 1] (``top_p``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


probability.__name__ = "number in (0, 1]"


def dtype_name(text: str) -> str:
    """An argparse ``type`` for ``--dtype``: ``auto`` or a dtype ``draftheads.base_model`` knows."""
    from draftheads.base_model import DEFAULT_DTYPE, DTYPES

    if text != DEFAULT_DTYPE and text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected {DEFAULT_DTYPE} or one of {sorted(DTYPES)}, got '{text}'")
    return text


dtype_name.__name__ = "dtype"


def device_name(text: str) -> str:
    """An argparse ``type`` for ``--device``: ``auto`` (this process's GPU where CUDA is, else the
    CPU: ``draftheads.device``) or anything ``torch.device`` parses (cpu, cuda, cuda:1); returns
    the device it names, ``auto`` resolved."""
    from draftheads.device import AUTO, auto_device

    if text == AUTO:
        return str(auto_device())
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"not a torch device: '{text}' (auto, cpu, cuda, cuda:1, ...)"
        ) from None
    return text


device_name.__name__ = "device"


def add_draft_dtype_argument(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """``--draft-dtype``: the dtype the head drafts in (``draftheads.infer.precision``); with
    ``several``, one or more (a list), each head running once per dtype (bench)."""
    from draftheads.infer.precision import DEFAULT_DRAFT_DTYPE, DRAFT_DTYPES

    parser.add_argument(
        "--draft-dtype",
        nargs="+" if several else None,
        choices=DRAFT_DTYPES,
        default=[DEFAULT_DRAFT_DTYPE] if several else DEFAULT_DRAFT_DTYPE,
        help="dtype the head drafts in; the base verifies in --dtype either way, so the output does not "
        "change (default auto: bf16 for an EAGLE-3 head beside an fp32 base on a CPU with AVX512_BF16 "
        "or AMX, else the base's dtype; int8: int8 linear weights, on the CPU)"
        + ("; several: each head runs once per dtype, named <kind>:<head>@<dtype>" if several else ""),
    )


PACK_SETTINGS = {"auto": "auto", "on": True, "off": False}  # --pack values -> ``pack=`` of the API


def pack_setting(text: str) -> bool | str:
    """An argparse ``type`` for ``--pack``: auto | on | off."""
    if text not in PACK_SETTINGS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(PACK_SETTINGS)}, got '{text}'")
    return PACK_SETTINGS[text]


def add_pack_argument(parser: argparse.ArgumentParser) -> None:
    """``--pack auto|on|off`` (``--no-pack``: off): which linear kernels decode
    (``draftheads.infer.kernel_choice``)."""
    from draftheads.infer.kernel_choice import DEFAULT_PACK

    parser.add_argument(
        "--pack",
        type=pack_setting,
        default=DEFAULT_PACK,
        metavar="{auto,on,off}",
        help="prepack fp32 linear weights for oneDNN on CPU: auto (default) for the forwards where that "
        "measured faster on this machine (measured once, cached), on for all, off for none",
    )
    parser.add_argument("--no-pack", dest="pack", action="store_const", const=False, help="--pack off")


def add_template_argument(parser: argparse.ArgumentParser) -> None:
    """``--template auto|chat|plain``: how chat prompts are rendered (``draftheads.prompt_format``,
    the rule training's ``data.template`` follows)."""
    from draftheads.prompt_format import DEFAULT_TEMPLATE, TEMPLATES

    parser.add_argument(
        "--template",
        choices=TEMPLATES,
        default=DEFAULT_TEMPLATE,
        help="render prompts with the chat template (chat) or as 'User: ...' / 'Assistant:' text (plain, "
        "for a pretrained base; answers stop where the model begins the next 'User:' turn); auto "
        "(default): chat where the tokenizer has a template, else plain, as training's data.template",
    )


def add_tuning_prompt_arguments(parser: argparse.ArgumentParser, defaults, saved: str) -> None:
    """The head and the prompts a tuning command decodes (``tune-tree``, ``fit-confidence``):
    ``--heads`` (where ``saved`` is written), ``--base``, ``--data``, ``--template``, ``--skip``,
    ``--prompts``, ``--max-new-tokens``, ``--max-prompt-tokens``; defaults from the command's
    settings (``defaults``)."""
    parser.add_argument("--heads", required=True, help=f"head directory; the {saved} is saved there")
    parser.add_argument("--base", default=None, help="base model (default: the one recorded in the head)")
    parser.add_argument("--data", default=defaults.data, help="mt-bench | humaneval | conversation source")
    add_template_argument(parser)
    parser.add_argument(
        "--skip",
        type=non_negative_int,
        default=defaults.skip,
        help="skip the first N prompts (training data)",
    )
    parser.add_argument("--prompts", type=positive_int, default=defaults.prompts, help="prompts decoded")
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens)
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=defaults.max_prompt_tokens)
