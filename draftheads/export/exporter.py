"""``export_head``: a trained head directory -> a Hub-ready directory in one format, with its model
card, its ``bench.json`` if recorded, and a Medusa-2 head's base adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftheads.export.model_card import BENCH_NAME, read_bench, render_model_card
from draftheads.export.registry import FORMAT_REGISTRY, ExportOptions, FormatError, export_format, write_head
from draftheads.heads.base import CONFIG_NAME

DEFAULT_FORMAT = "draftheads"
CARD_NAME = "README.md"


def export_head(
    heads_dir: str | Path,
    out_dir: str | Path,
    format_name: str = DEFAULT_FORMAT,
    base: str | None = None,
    options: ExportOptions | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write the head in ``heads_dir`` (any format ``load_head`` reads) to ``out_dir`` in ``format_name``,
    with a README.md model card (and the head's bench.json, if recorded). Returns the files written.

    ``base`` (Hub id, directory or alias) is loaded only when the format stores base tensors;
    default: the base model named in the head's config (``resolve_base_model``)."""
    from draftheads.heads import load_head, resolve_base_model

    heads_dir, out_dir = Path(heads_dir), Path(out_dir)
    if heads_dir.resolve() == out_dir.resolve():
        raise ValueError(f"--out {out_dir} is the head directory itself; choose another directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {out_dir} exists and is not empty (pass --overwrite to replace it)")
    config_path = heads_dir / CONFIG_NAME
    source_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
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
    if chosen.needs_base_weights(head):
        from draftheads.base_model import load_base

        base_model, _ = load_base(resolve_base_model(heads_dir, base), dtype=next(head.parameters()).dtype)
        head.attach(base_model)
    if out_dir.exists() and overwrite:
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_head(head, out_dir, format_name, options)
    if joint:  # Medusa-2: the base adapter travels with the heads
        from draftheads.heads.adapter import ADAPTER_DIR

        shutil.copytree(heads_dir / ADAPTER_DIR, out_dir / ADAPTER_DIR)

    card_config = head.config_dict()
    if source_config.get("training"):
        card_config["training"] = source_config["training"]
    bench = read_bench(heads_dir)
    if bench is not None:
        shutil.copyfile(heads_dir / BENCH_NAME, out_dir / BENCH_NAME)
    parameters = sum(t.numel() for t in head.head_state_dict().values() if t.is_floating_point())
    card = render_model_card(card_config, parameters, bench)
    if format_name != DEFAULT_FORMAT:
        card += (
            f"\nThis copy is in the `{format_name}` layout ({FORMAT_REGISTRY[format_name].loaded_by}); "
            "draftheads `load_head` reads it too.\n"
        )
    (out_dir / CARD_NAME).write_text(card)
    return sorted(p for p in out_dir.iterdir() if p.is_file())
