"""``export_head``: a trained head directory -> a Hub-ready directory in one format, with its model
card, its ``bench.json`` (and, in the ``draftheads`` format, its ``tree.json``) if recorded, a
Medusa-2 head's base adapter, and the manifest that lets a later ``--overwrite`` recognise it
(``destination``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftheads.export.destination import check_destination, staged_export, write_manifest
from draftheads.export.model_card import BENCH_NAME, read_bench, render_model_card
from draftheads.export.public import strip_local_paths
from draftheads.export.registry import FORMAT_REGISTRY, ExportOptions, FormatError, export_format, write_head
from draftheads.heads.base import (
    inside_head,
    object_field,
    read_head_config,
    read_json_object,
    resolve_head_dir,
)
from draftheads.infer.confidence import CONFIDENCE_CONFIG, CONFIDENCE_FILE
from draftheads.infer.tree import TUNED_TREE_FILE
from draftheads.storage import check_free_space

DEFAULT_FORMAT = "draftheads"
CARD_NAME = "README.md"
# Beyond the tensors: config.json (it embeds the base config), the model card, safetensors
# headers and filesystem blocks; generous, since a refusal costs less than a full disk.
SPACE_MARGIN_BYTES = 8 * 2**20


# What tuning saved beside the head, carried by a draftheads-format export (generate and bench read
# them with the head): the tree tune-tree chose and the acceptance head fit-confidence fitted. The
# JSON records are written with local paths replaced by file names, as the card is; the rest copied.
TRAVELLING_RECORDS = (TUNED_TREE_FILE, CONFIDENCE_CONFIG)
TRAVELLING_FILES = (CONFIDENCE_FILE,)


def check_travelling_files(heads_dir: Path) -> None:
    """Refuse (HeadFormatError naming it) a file the export would copy from the head that is a
    link out of it (``inside_head``): the tuning records and files, and a Medusa-2 adapter's every
    file and folder (``copytree`` would copy a linked target's bytes)."""
    from draftheads.heads.adapter import ADAPTER_DIR

    for name in (*TRAVELLING_RECORDS, *TRAVELLING_FILES):
        inside_head(heads_dir, heads_dir / name)
    adapter = inside_head(heads_dir, heads_dir / ADAPTER_DIR)
    for path in adapter.rglob("*") if adapter.is_dir() else ():
        inside_head(heads_dir, path)


def read_travelling_records(heads_dir: Path) -> dict[str, dict]:
    """The tuning records a draftheads-format export carries, by file name, each a JSON object
    (``read_json_object``), and the confidence head they describe loaded once (``load_confidence``):
    a damaged one raises HeadFormatError naming the file and the field before any heavy loading."""
    from draftheads.infer.confidence import load_confidence

    records = {
        name: read_json_object(heads_dir / name)
        for name in TRAVELLING_RECORDS
        if (heads_dir / name).is_file()
    }
    if CONFIDENCE_CONFIG in records:
        load_confidence(heads_dir)
    return records


def estimated_bytes(head, heads_dir: Path, with_base_weights: bool, joint: bool) -> int:
    """What an export of ``head`` writes, at most: its tensors, the frozen base tensors a format may
    store (embedding and lm_head), a Medusa-2 adapter and bench.json, plus ``SPACE_MARGIN_BYTES``."""
    tensors = list(head.head_state_dict().values())
    if with_base_weights:
        tensors += [head.embed_tokens.weight, head.base_lm_head.weight]
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)  # tied tensors are written twice
    copied = [heads_dir / name for name in (BENCH_NAME, *TRAVELLING_RECORDS, *TRAVELLING_FILES)]
    if joint:
        from draftheads.heads.adapter import ADAPTER_DIR

        copied += list((heads_dir / ADAPTER_DIR).rglob("*"))
    return tensor_bytes + sum(p.stat().st_size for p in copied if p.is_file()) + SPACE_MARGIN_BYTES


def export_head(
    heads_dir: str | Path,
    out_dir: str | Path,
    format_name: str = DEFAULT_FORMAT,
    base: str | None = None,
    options: ExportOptions | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the head in ``heads_dir`` (any format ``load_head`` reads, a training run's output
    directory, or one of its checkpoints ``<run>/checkpoints/step-N``) to ``out_dir`` in
    ``format_name``, with a README.md model card (and the head's bench.json, if recorded) and a
    manifest of the files written; the card and bench.json name local files by file name only
    (``public``). Returns the files written.

    ``out_dir`` must be absent, empty, or (``overwrite``) a previous export and nothing else
    (``destination.check_destination``); the export is staged next to it and renamed into place
    complete, so a failure leaves a previous export intact. ``base`` (Hub id, directory or alias)
    is loaded only when the format stores base tensors; default: the base model named in the
    head's config (``resolve_base_model``)."""
    from draftheads.heads import load_head, resolve_base_model

    heads_dir, out_dir = resolve_head_dir(heads_dir), Path(out_dir)
    check_destination(out_dir, heads_dir, overwrite)  # refuse before any heavy loading
    config_path, source_config = read_head_config(heads_dir)
    training = object_field(source_config, "training", config_path, optional=True)  # the card reads it
    bench = read_bench(heads_dir)  # refuse a damaged bench.json before any heavy loading
    check_travelling_files(heads_dir)  # and a link out of the head: export would publish its target
    travelling = format_name == DEFAULT_FORMAT
    records = read_travelling_records(heads_dir) if travelling else {}
    head = load_head(heads_dir)
    chosen = export_format(format_name, head.kind)  # refuse impossible pairs before any heavy loading
    joint = bool(getattr(head.config, "joint", False))
    if joint and format_name != DEFAULT_FORMAT:
        raise FormatError(
            f"{heads_dir} holds Medusa-2 heads trained with a base adapter; '{format_name}' has no place "
            "for the adapter and the engine would verify with the original base. "
            f"Export as '{DEFAULT_FORMAT}', or merge the adapter into the base (peft merge_and_unload) "
            "and serve that model"
        )
    with_base_weights = chosen.needs_base_weights(head)
    if with_base_weights:
        from draftheads.base_model import load_base

        base_model, _ = load_base(resolve_base_model(heads_dir, base), dtype=next(head.parameters()).dtype)
        head.attach(base_model)
    needed = estimated_bytes(head, heads_dir, with_base_weights, joint)
    check_free_space(out_dir, needed, f"the {format_name} export")

    with staged_export(out_dir, heads_dir, overwrite) as staging:
        write_head(head, staging, format_name, options)
        if joint:  # Medusa-2: the base adapter travels with the heads
            from draftheads.heads.adapter import ADAPTER_DIR

            shutil.copytree(heads_dir / ADAPTER_DIR, staging / ADAPTER_DIR)
        # The card and bench.json name data, runs and heads by file name only (``public``).
        card_config = head.config_dict()
        if training:
            card_config["training"] = training
        card_config = strip_local_paths(card_config)
        if bench is not None:
            bench = strip_local_paths(bench)
            (staging / BENCH_NAME).write_text(json.dumps(bench, indent=2) + "\n")
        for name, record in records.items():
            (staging / name).write_text(json.dumps(strip_local_paths(record), indent=2) + "\n")
        for name in TRAVELLING_FILES if travelling else ():
            if (heads_dir / name).is_file():
                shutil.copyfile(heads_dir / name, staging / name)
        parameters = sum(t.numel() for t in head.head_state_dict().values() if t.is_floating_point())
        card = render_model_card(card_config, parameters, bench)
        if format_name != DEFAULT_FORMAT:
            card += (
                f"\nThis copy is in the `{format_name}` layout ({FORMAT_REGISTRY[format_name].loaded_by}); "
                "draftheads `load_head` reads it too.\n"
            )
        (staging / CARD_NAME).write_text(card)
        files = write_manifest(staging, format_name, head.kind)
    return [out_dir / name for name in files]
