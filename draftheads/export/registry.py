"""The two export registries: format name -> writer, and engine config.json -> reader.

A format family's module (``native``, ``eagle3``, ``eagle``, ``medusa``, ``mtp``) registers its
writers with ``@register_writer`` and its readers with ``@register_reader``; importing
``draftheads.export`` imports them all, in the order the registries list them. A format name nobody
registered, a head kind a format cannot hold, or a checkpoint no reader recognises raises
``FormatError`` saying what would work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from draftheads.heads.base import DraftHead, HeadFormatError


class FormatError(HeadFormatError):
    """A head cannot be written in, or a checkpoint read from, an engine format; says why."""


@dataclass(frozen=True)
class ExportOptions:
    """Format-specific choices; each default is defined here once."""

    # speculators: proposal length vLLM defaults ``num_speculative_tokens`` to (base.py reads
    # speculators_config.proposal_methods[0].speculative_tokens); None: an EAGLE-3 head's
    # DEFAULT_SPECULATIVE_TOKENS, a P-EAGLE or DFlash head's trained depth (``proposal_length``).
    speculative_tokens: int | None = None
    # speculators / model card: the verifier (base model) name engines resolve; default: the name
    # recorded in the head's config.
    verifier: str | None = None
    # gguf: the base's GGUF (the file llama.cpp verifies with), whose vocabulary the draft copies;
    # default: the embedded GGUF of an embedded base.
    target_gguf: str | None = None


DEFAULT_SPECULATIVE_TOKENS = 3


def proposal_length(options: ExportOptions, kind: str, trained_depth: int | None = None) -> int:
    """The proposal length a speculators export records: ``options.speculative_tokens``, by default
    ``DEFAULT_SPECULATIVE_TOKENS``; for a head that drafts a fixed depth in one forward (P-EAGLE,
    DFlash: ``trained_depth``), that depth. Asking such a head for another length raises ConfigError
    naming both numbers: the export would record its depth, not the length asked for."""
    from draftheads.settings import ConfigError

    asked = options.speculative_tokens
    if trained_depth is None:
        return DEFAULT_SPECULATIVE_TOKENS if asked is None else asked
    if asked is not None and asked != trained_depth:
        raise ConfigError(
            f"--speculative-tokens {asked}: a {kind} head drafts its {trained_depth} trained depths in one "
            f"forward, and its export records {trained_depth}; omit the option or pass "
            f"--speculative-tokens {trained_depth} (train with more depths to draft more)"
        )
    return trained_depth


# ---- writers ----------------------------------------------------------------------------------

Writer = Callable[[DraftHead, Path, ExportOptions], dict[str, Any]]


def _never(head: DraftHead) -> bool:
    return False


@dataclass(frozen=True)
class ExportFormat:
    """One output layout: which head kinds it can express, who loads it, and its writer."""

    name: str
    head_kinds: tuple[str, ...]
    loaded_by: str
    write: Writer  # (head, directory, options) -> the config.json written, as a reader sees it
    # Does the writer store frozen base tensors, so the head must be attached to its base model?
    needs_base_weights: Callable[[DraftHead], bool] = _never


FORMAT_REGISTRY: dict[str, ExportFormat] = {}


def register_writer(
    name: str,
    head_kinds: tuple[str, ...],
    loaded_by: str,
    needs_base_weights: Callable[[DraftHead], bool] = _never,
) -> Callable[[Writer], Writer]:
    """Function decorator: make ``name`` a format ``write_head`` and ``draftheads export`` know."""

    def register(write: Writer) -> Writer:
        if not name or name in FORMAT_REGISTRY:
            raise ValueError(f"export format '{name}' is empty or registered twice")
        FORMAT_REGISTRY[name] = ExportFormat(name, tuple(head_kinds), loaded_by, write, needs_base_weights)
        return write

    return register


def formats_for(kind: str) -> list[str]:
    return [name for name, chosen in FORMAT_REGISTRY.items() if kind in chosen.head_kinds]


def export_format(name: str, head_kind: str) -> ExportFormat:
    """Look up a format and check it can express ``head_kind``; errors list what would work."""
    if name not in FORMAT_REGISTRY:
        raise FormatError(f"unknown export format '{name}'; known formats: {', '.join(FORMAT_REGISTRY)}")
    chosen = FORMAT_REGISTRY[name]
    if head_kind not in chosen.head_kinds:
        raise FormatError(
            f"format '{name}' cannot express a {head_kind} head (it holds: {', '.join(chosen.head_kinds)}); "
            f"formats for {head_kind} heads: {', '.join(formats_for(head_kind))}"
        )
    return chosen


def write_head(
    head: DraftHead, directory: str | Path, format_name: str, options: ExportOptions | None = None
):
    """Write ``head`` into ``directory`` in ``format_name``; returns the config dict written."""
    chosen = export_format(format_name, head.kind)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return chosen.write(head, directory, options or ExportOptions())


# ---- readers ----------------------------------------------------------------------------------


class EngineReader:
    """How one engine format reads back into a head. ``draftheads.export.reading`` runs the steps
    every format shares and asks the reader for what differs; the defaults suit a format whose
    config.json is the draft layer's own config."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # the head kind it reads into
    description: ClassVar[str] = ""  # how the error for an unreadable checkpoint lists it
    # Engine config fields that must equal the base model's: the drafter is built from them.
    geometry_fields: ClassVar[tuple[str, ...]] = ("hidden_size", "vocab_size")
    # Where the engine config itself names the base model (a dotted path), if it does.
    base_name_field: ClassVar[str | None] = None

    def recognises(self, saved: dict[str, Any]) -> bool:
        """Is ``saved`` (a config.json) in this format, by its own fields?"""
        raise NotImplementedError

    def recognises_layout(self, tensors: dict[str, torch.Tensor]) -> bool:
        """For a config.json no reader recognises: are these tensors this format's? (default: no)"""
        return False

    def engine_config(self, saved: dict[str, Any], where: Path) -> dict[str, Any]:
        """The flat engine config the other steps read (default: config.json as it is)."""
        return dict(saved)

    def base_config_fields(self, config: dict[str, Any]) -> dict[str, Any]:
        """Base-config fields (``model_type`` included, if known) the engine config implies: what the
        base config is rebuilt from when no base model is given."""
        return {name: config[name] for name in self.geometry_fields if name in config}

    def base_num_layers(self, config: dict[str, Any]) -> tuple[int, str] | None:
        """The base depth the engine config implies and how it was inferred, or None."""
        return None

    def head_config_values(self, config: dict[str, Any], base_num_layers: int) -> dict[str, Any]:
        """Head-config fields the engine config implies (for checkpoints without our metadata)."""
        return {}

    def head_state(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], where: Path
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Engine tensor names -> the head's parameter names (the inverse of the writer), and notes
        on tensors left out."""
        raise NotImplementedError

    def fit_state(
        self, state: dict[str, torch.Tensor], head: DraftHead, base_model, where: Path
    ) -> dict[str, torch.Tensor]:
        """Adjust the renamed tensors to the head built from the config (default: as they are)."""
        return state


READER_REGISTRY: dict[str, EngineReader] = {}


def register_reader(cls: type[EngineReader]) -> type[EngineReader]:
    """Class decorator: make ``load_head`` read the format ``cls`` recognises."""
    if not cls.name or cls.name in READER_REGISTRY:
        raise ValueError(f"engine reader '{cls.name}' is empty or registered twice")
    READER_REGISTRY[cls.name] = cls()
    return cls


def recognising_readers(
    saved: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None
) -> list[EngineReader]:
    """The readers that recognise ``saved`` by its fields; if none does and ``tensors`` are given,
    those that recognise the tensor layout."""
    found = [reader for reader in READER_REGISTRY.values() if reader.recognises(saved)]
    if not found and tensors is not None:
        found = [reader for reader in READER_REGISTRY.values() if reader.recognises_layout(tensors)]
    return found


def find_reader(saved: dict[str, Any], tensors: dict[str, torch.Tensor], where: Path) -> EngineReader:
    """The one reader for the checkpoint whose config.json (at ``where``) is ``saved``."""
    found = recognising_readers(saved, tensors)
    if len(found) > 1:
        raise FormatError(
            f"{where}: recognised as several formats ({', '.join(r.name for r in found)}); "
            "cannot tell which one to read"
        )
    if not found:
        readable = ", ".join(["draftheads"] + [reader.description for reader in READER_REGISTRY.values()])
        raise FormatError(
            f"{where}: not a format draftheads reads (config 'format' is not 'draftheads', architectures "
            f"{saved.get('architectures') or []}); readable: {readable}"
        )
    return found[0]
