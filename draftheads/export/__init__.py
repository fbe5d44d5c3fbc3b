"""Export and import of engine formats: writers and readers behind registries, model cards, Hub upload.

- ``registry``: format name -> writer (``FORMAT_REGISTRY``), engine config.json -> reader
  (``READER_REGISTRY``), ``FormatError``, ``ExportOptions``.
- one module per format family: ``native`` (our own), ``eagle3`` (eagle3, speculators), ``eagle``
  (eagle, eagle-sglang), ``medusa`` (medusa-vllm), ``mtp`` (mtp-deepseek), ``dflash`` (dflash,
  dflash-speculators), ``gguf`` (gguf: llama.cpp).
- ``reading``: what every reader shares (``load_head`` reads engine formats through it).
- ``exporter`` (``export_head``), ``destination`` (the manifest, what ``--overwrite`` may replace,
  the staged write renamed into place), ``model_card``, ``hub`` (``push_to_hub``).

Importing this package registers every format (in the order errors and ``--format`` list them);
nothing else runs at import time. It depends on ``draftheads.heads``, never the other way round.
"""

from draftheads.export.registry import (
    FORMAT_REGISTRY,
    READER_REGISTRY,
    EngineReader,
    ExportFormat,
    ExportOptions,
    FormatError,
    export_format,
    find_reader,
    formats_for,
    register_reader,
    register_writer,
    write_head,
)

# Importing the families registers their writers and readers, in this order: the order in which
# ``--format`` and the errors list them.
# isort: off
from draftheads.export import native, eagle3, eagle, medusa, mtp, dflash, gguf  # noqa: F401

# isort: on
from draftheads.export.checkpoint import DRAFTHEADS_KEY
from draftheads.export.destination import MANIFEST_NAME, DestinationError
from draftheads.export.exporter import CARD_NAME, DEFAULT_FORMAT, export_head
from draftheads.export.hub import HubError, push_to_hub
from draftheads.export.model_card import BENCH_NAME, read_bench, render_model_card
from draftheads.export.reading import read_engine_head, recorded_base_fields, recorded_base_name

__all__ = [
    "BENCH_NAME",
    "CARD_NAME",
    "DEFAULT_FORMAT",
    "DRAFTHEADS_KEY",
    "FORMAT_REGISTRY",
    "MANIFEST_NAME",
    "READER_REGISTRY",
    "DestinationError",
    "EngineReader",
    "ExportFormat",
    "ExportOptions",
    "FormatError",
    "HubError",
    "export_format",
    "export_head",
    "find_reader",
    "formats_for",
    "push_to_hub",
    "read_bench",
    "read_engine_head",
    "recorded_base_fields",
    "recorded_base_name",
    "register_reader",
    "register_writer",
    "render_model_card",
    "write_head",
]
