"""The ``draftheads`` format: our own config.json + model.safetensors (``DraftHead.save_pretrained``),
which ``load_head`` reads exactly and every head kind fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftheads.export.registry import ExportOptions, register_writer
from draftheads.heads.base import CONFIG_NAME, DraftHead


@register_writer(
    "draftheads", ("medusa", "eagle", "eagle3", "peagle", "mtp", "dflash"), "draftheads load_head"
)
def write_draftheads(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    head.save_pretrained(directory)
    return json.loads((directory / CONFIG_NAME).read_text())
