"""Which linear kernels decode fastest on this machine: packed (oneDNN) or PyTorch's default (MKL).

Prepacking fp32 weights for oneDNN (``draftheads.infer.packed``) brings a tree verification close
to a one-token forward, but whether it pays depends on the CPU: on one x86 machine it sped plain
decoding up, on another it slowed it down against MKL's one-row kernel (docs/inference.md). So
``pack="auto"`` decides by measurement: the first load on a machine times one-token forwards
(plain decoding) and multi-token forwards (verification) of the model, packed and unpacked,
interleaved, and keeps whichever is faster for each form, so plain decoding and verification can
each get their own kernel (``PackedLinear`` switches per forward, losslessly).

The choice is cached in ``<cache dir>/kernels.json`` keyed by what it depends on (CPU model and
vector extensions, threads, torch version, the model and its dtype), so later loads cost nothing
and a changed CPU or torch re-measures. A measurement the machine-speed check
(``draftheads.speed_probe.machine_busy``) calls busy is used but not cached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftheads.infer.packed import (
    FORMS,
    MULTI_TOKEN,
    ONE_TOKEN,
    pack_linears,
    packed_forms,
    packing_supported,
)
from draftheads.speed_probe import forward_seconds, machine_busy
from draftheads.storage import write_text_atomically

PACK_CHOICES = ("auto", True, False)  # ``pack``: measure, always pack, never pack
DEFAULT_PACK = "auto"
LAYOUTS = ("default", "packed")
CACHE_FILE = "kernels.json"
VERIFY_TOKENS = 8  # tokens of the timed multi-token forward: a typical adaptive tree's size
MEASURE_ROUNDS = 5  # interleaved rounds per (form, layout); each round's fastest of PROBE_RUNS counts

# (form, layout) -> one figure per round, in seconds
Timings = dict[tuple[str, str], list[float]]


@dataclass(frozen=True)
class KernelChoice:
    """The forward forms (``packed.FORMS``) that run packed, and how that was decided: ``measured``,
    ``measured (busy machine, not cached)``, ``cached``, ``requested`` or ``unsupported`` (no oneDNN
    fp32 packing for this model here). ``seconds``: the fastest timing per form and layout when
    measured (or cached)."""

    packed: frozenset[str]
    source: str
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def describe(self) -> str:
        forms = ", ".join(f"{form} {'packed' if form in self.packed else 'default'}" for form in FORMS)
        return f"{forms} ({self.source})"


def check_pack(pack) -> None:
    if not (pack is True or pack is False or pack == DEFAULT_PACK):
        raise ValueError(f"pack must be 'auto', True or False, got {pack!r}")


def model_identity(model) -> dict:
    """What of a model its kernels' speed depends on: its name and the shapes of its layers."""
    config = model.config
    return {
        "name": str(getattr(config, "_name_or_path", "")),
        "model_type": getattr(config, "model_type", None),
        "shapes": [
            getattr(config, key, None)
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        ],
    }


def cache_key(model) -> dict:
    """Everything the choice depends on (a changed entry re-measures)."""
    from draftheads.machine import cpu_flags, cpu_name

    return {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": model_identity(model),
        "dtype": str(model.dtype).removeprefix("torch."),
    }


def _entry_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_path() -> Path:
    from draftheads.base_model import cache_dir

    return cache_dir() / CACHE_FILE


def read_cache(path: Path) -> dict:
    """The cache's entries by id; an unreadable or foreign file reads as empty (it is re-measured)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_cache(path: Path, entries: dict) -> None:
    """Replace the cache file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")


def time_forwards(model, rounds: int = MEASURE_ROUNDS) -> Timings:
    """One-token and ``VERIFY_TOKENS``-token forwards of ``model`` (packed for every form) on each
    layout, interleaved round by round so a slow spell falls on all of them."""
    token = min(1, model.config.vocab_size - 1)
    inputs = {
        ONE_TOKEN: torch.full((1, 1), token, dtype=torch.long),
        MULTI_TOKEN: torch.full((1, VERIFY_TOKENS), token, dtype=torch.long),
    }
    timings: Timings = {(form, layout): [] for form in FORMS for layout in LAYOUTS}
    for form in FORMS:  # warm-up: first calls allocate and pick kernels
        for layout in LAYOUTS:
            with packed_forms(FORMS if layout == "packed" else ()):
                forward_seconds(model, inputs[form], runs=1)
    for _ in range(rounds):
        for form in FORMS:
            for layout in LAYOUTS:
                with packed_forms(FORMS if layout == "packed" else ()):
                    timings[(form, layout)].append(forward_seconds(model, inputs[form]))
    return timings


def decide(timings: Timings) -> tuple[frozenset[str], dict[str, dict[str, float]], bool]:
    """The forms packing wins (fastest round against fastest round), the fastest figures, and
    whether any layout's rounds say the machine was busy."""
    fastest = {form: {layout: min(timings[(form, layout)]) for layout in LAYOUTS} for form in FORMS}
    packed = frozenset(form for form in FORMS if fastest[form]["packed"] < fastest[form]["default"])
    return packed, fastest, any(machine_busy(seconds) for seconds in timings.values())


def choose_kernels(
    model,
    pack=DEFAULT_PACK,
    cache_path: Path | None = None,
    measure: Callable[[object], Timings] | None = None,
) -> KernelChoice:
    """Pack ``model``'s linear layers for the forms that decode fastest and return the choice.

    ``pack``: ``auto`` (the cached choice for this machine and model, else measured with
    ``measure``, by default ``time_forwards``, and cached unless the machine was busy), True
    (every form packed where packing applies) or False (the default kernels). Where packing does
    not apply (not fp32 on an x86 CPU with oneDNN) nothing is packed."""
    check_pack(pack)
    if not packing_supported(model):
        return KernelChoice(frozenset(), "unsupported")
    if pack is True or pack is False:
        choice = KernelChoice(frozenset(FORMS) if pack else frozenset(), "requested")
    else:
        choice = cached_or_measured(model, cache_path or default_cache_path(), measure or time_forwards)
    pack_linears(model, forms=choice.packed)  # no forms: the layers stay (or become) nn.Linear
    return choice


def cached_or_measured(model, path: Path, measure: Callable[[object], Timings]) -> KernelChoice:
    key = cache_key(model)
    entries = read_cache(path)
    entry = entries.get(_entry_id(key))
    if isinstance(entry, dict) and entry.get("key") == key and set(entry.get("packed", ())) <= set(FORMS):
        return KernelChoice(frozenset(entry["packed"]), "cached", entry.get("seconds", {}))
    pack_linears(model)  # both layouts live on one model: ``packed_forms`` picks per measurement
    packed, fastest, busy = decide(measure(model))
    if busy:
        return KernelChoice(packed, "measured (busy machine, not cached)", fastest)
    entries = read_cache(path)  # another process may have added its own meanwhile
    entries[_entry_id(key)] = {"key": key, "packed": sorted(packed), "seconds": fastest}
    write_cache(path, entries)
    return KernelChoice(packed, "measured", fastest)


def prepare_drafting_head(head, model, kernels: KernelChoice, draft_dtype: str | None = None) -> str:
    """Put ``head`` in the dtype it drafts in beside ``model`` (``draftheads.infer.precision``) and
    pack its floating-point linear layers, for every form, when ``kernels`` packs the base for any;
    returns what it drafts in (``precision.prepare_head``)."""
    from draftheads.infer.precision import DEFAULT_DRAFT_DTYPE, prepare_head

    pack = bool(kernels.packed)
    dtype = prepare_head(head, model, draft_dtype or DEFAULT_DRAFT_DTYPE, pack)
    if pack:
        pack_linears(head)
    return dtype
