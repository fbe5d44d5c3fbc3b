"""The draft heads this project ships, by short name: the one place that knows where they live.

Every command that takes a head (``--heads``), ``SpeculativeGenerator.from_pretrained``, the demo and
the engine check accept these names, through ``draftheads.heads.base.resolve_head_dir``; moving the
heads (to the Hugging Face Hub, say) changes this file only. Their model cards (README.md in each
directory) say what each is, how it was trained and what it measured.
"""

from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]  # the heads come with a git checkout, not the wheel
# short name -> directory, relative to the checkout
SHIPPED_HEADS: dict[str, str] = {
    "eagle3-smollm2": "docs/results/heads/eagle3-corpus-both",  # EAGLE-3 for SmolLM2-135M-Instruct
    "dflash-smollm2": "docs/results/heads/dflash-corpus",  # DFlash for SmolLM2-135M-Instruct
    "eagle3-gemma3": "docs/results/heads/eagle3-gemma3",  # EAGLE-3 for Gemma 3 270M (pretrained)
}


def shipped_head_dir(name: str) -> Path:
    """The directory of the shipped head called ``name`` (a key of ``SHIPPED_HEADS``); KeyError if
    there is none of that name."""
    return CHECKOUT / SHIPPED_HEADS[name]


def resolve_head_dir(name_or_path: str | Path) -> Path:
    """The path ``name_or_path`` names: itself when it exists (an existing path wins over a short
    name), else the directory of the shipped head of that name. Raises HeadFormatError, one line,
    for a path that does not exist, a name no shipped head has (listing those there are), or a
    shipped head missing from this installation."""
    from draftheads.heads.base import HeadFormatError

    path = Path(name_or_path)
    if path.exists():
        return path
    name = str(name_or_path)
    if name in SHIPPED_HEADS:
        directory = shipped_head_dir(name)
        if not directory.is_dir():
            raise HeadFormatError(
                f"shipped head {name} is not at {directory}: the shipped heads come with a git checkout "
                "of draftheads, not with the installed package"
            )
        return directory
    if len(path.parts) > 1 or path.is_absolute():  # spelled as a path: no name was meant
        raise HeadFormatError(f"head directory {name} does not exist")
    raise HeadFormatError(
        f"head directory {name} does not exist, and no shipped head has that name "
        f"(shipped heads: {', '.join(SHIPPED_HEADS)})"
    )
