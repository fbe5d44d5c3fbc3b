"""Conversations -> tokenised training examples: ``build_datasets(data, tokenizer, base_name)``.

source -> normalised conversations (sources.py) -> text with an assistant-only loss mask, by the
tokenizer's chat template or as plain text (``data.template``: rendering.py) ->
``max_length`` truncation -> drop examples with no supervised token -> a
deterministic train/validation split -> saved with ``datasets`` under a key of everything that
shapes the result (source file identity, tokenizer and chat template, every DataConfig field), so
a second build with the same inputs only memory-maps the saved arrow files.

Rows: ``input_ids`` (int32), ``loss_mask`` (int8, same length), ``length``, ``id``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from draftheads.config import DataConfig
from draftheads.data.hub_dataset import pinned_source
from draftheads.data.rendering import Rendering, resolve_rendering
from draftheads.data.sources import DataError, SourceReport, TruncatedTail, read_conversations, resolve_source
from draftheads.data.template import EncodeFailure, chat_template

PIPELINE_VERSION = 2  # part of the cache key: bump whenever the produced rows change
ENCODE_BATCH = 256
HISTOGRAM_BINS = 8
EXAMPLES_PER_REASON = 3
LENGTH_DROP = "no_supervised_tokens"  # the drop reason of examples cut before any assistant token
HELD_OUT_DROP = "held_out_id"  # an extra source's example with the id of a held-out one


@dataclass
class DataReport:
    """Everything a build found, kept next to the cached datasets so a cache hit reports it too."""

    source: str
    conversations_read: int  # records seen in the source (complete ones, for a truncated file)
    conversations_valid: int  # records that normalised into conversations, past data.skip (<= limit)
    examples: int  # tokenised examples kept (train + validation)
    train_examples: int
    validation_examples: int
    dropped: dict[str, int]  # reason -> count, source and tokenisation drops together
    drop_examples: dict[str, list[str]]  # reason -> a few "where: what" lines
    repairs: dict[str, int]  # e.g. leading assistant turns removed
    truncated_tail: TruncatedTail | None
    truncated_examples: int  # examples longer than max_length, cut to it
    tokens: int  # tokens in kept examples (after truncation)
    assistant_tokens: int  # of those, under the loss mask
    mask_methods: dict[str, int]  # generation | prefix | search | plain -> examples
    boundary_tokens: int  # tokens straddling a mask edge (expected 0)
    length_histogram: list[tuple[int, int, int]]  # (low, high, examples with low <= length < high)
    max_length: int
    seconds: float = 0.0
    cache_hit: bool = False
    cache_path: str = ""
    template_end_of_turn: str = ""
    template: str = "chat"  # the rendering used (data.template resolved): chat | plain
    # data.extra_sources, each as {source, conversations_read, examples, tokens, assistant_tokens,
    # dropped}: their examples and tokens are counted in examples, train_examples, tokens and
    # assistant_tokens above; the other fields describe data.source alone
    extra_sources: list[dict] = dataclasses.field(default_factory=list)

    @property
    def assistant_share(self) -> float:
        return self.assistant_tokens / self.tokens if self.tokens else 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DataReport:
        data = json.loads(text)
        tail = data.pop("truncated_tail")
        data["length_histogram"] = [tuple(row) for row in data["length_histogram"]]
        return cls(truncated_tail=TruncatedTail(**tail) if tail else None, **data)


# ----------------------------------------------------------------------------------------------
# cache keys


def source_identity(source: str, split: str) -> str:
    """A string that changes when the source's content may have changed (path, size, mtime)."""
    kind, location = resolve_source(source)
    if kind == "corpus":  # its manifest holds every sealed chunk's sha256
        manifest = (Path(location) / "manifest.json").read_bytes()
        return f"corpus:{Path(location).resolve()}:" + hashlib.sha256(manifest).hexdigest()
    path = Path(str(location))
    if kind not in ("dataset", "directory"):
        stat = path.stat()
        return f"{kind}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        stamps = [f"{p.relative_to(path)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
        # "directory" (read file by file) and "dataset" (load_dataset) may give different rows.
        return f"{kind}:{path.resolve()}:{split}:" + hashlib.sha256("\n".join(stamps).encode()).hexdigest()
    return f"hub:{location}:{split}"  # a Hub id, pinned to its commit (hub_dataset.pinned_source)


def tokenizer_identity(tokenizer) -> str:
    """Hash of the vocabulary, normaliser, special tokens and chat template (none: "")."""
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    digest.update((chat_template(tokenizer) if tokenizer.chat_template else "").encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(data: DataConfig, tokenizer, rendering: Rendering) -> str:
    # Where caches live, and how many drops are tolerated, do not shape the rows. A skip of 0 is
    # left out, so entries written before data.skip existed keep their keys.
    fields = {
        name: value
        for name, value in dataclasses.asdict(data).items()
        if name not in ("cache_dir", "features", "max_drop_fraction", "extra_sources")
        and not (name == "skip" and value == 0)
    }
    parts = {
        "version": PIPELINE_VERSION,
        "source": source_identity(data.source, data.split),
        "tokenizer": tokenizer_identity(tokenizer),
        "rendering": rendering.name,  # data.template "auto" resolves by the tokenizer
        "data": fields,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def dataset_cache_root(data: DataConfig) -> Path:
    if data.cache_dir:
        return Path(data.cache_dir)
    from draftheads.base_model import cache_dir  # base imports torch; only needed for the default

    return cache_dir() / "datasets"


# ----------------------------------------------------------------------------------------------
# statistics


def length_histogram(
    lengths: list[int], max_length: int, bins: int = HISTOGRAM_BINS
) -> list[tuple[int, int, int]]:
    """Equal-width bins over [0, max_length]; the last bin includes max_length itself."""
    width = max(1, -(-max_length // bins))
    counts = [0] * bins
    for length in lengths:
        counts[min(length // width, bins - 1)] += 1
    highs = [min((index + 1) * width, max_length) for index in range(bins - 1)] + [max_length + 1]
    return [(index * width, high, count) for index, (high, count) in enumerate(zip(highs, counts))]


def dropped_records(dropped: dict[str, int]) -> int:
    """Records dropped as malformed or unusable: every drop but the examples that ``max_length``
    leaves without an assistant token, which a setting causes, not the file."""
    return sum(count for reason, count in dropped.items() if reason != LENGTH_DROP)


def check_drop_share(
    source: str,
    records: int,
    dropped: dict[str, int],
    examples: dict[str, list[str]],
    max_drop_fraction: float,
) -> None:
    """Raise ``DataError`` when more than ``max_drop_fraction`` of the ``records`` read were
    dropped: so many bad records usually mean a wrong file or format, and a warning scrolls by."""
    count = dropped_records(dropped)
    share = count / records if records else 0.0
    if share <= max_drop_fraction:
        return
    reasons = "; ".join(
        f"{reason} {number:,}" + (f" (e.g. {examples[reason][0]})" if examples.get(reason) else "")
        for reason, number in sorted(dropped.items(), key=lambda item: -item[1])
        if reason != LENGTH_DROP
    )
    raise DataError(
        f"{source}: {count:,} of {records:,} records dropped ({share:.1%}), more than "
        f"data.max_drop_fraction={max_drop_fraction}: {reasons}. Fix the file, or raise "
        "data.max_drop_fraction to train on the rest"
    )


def _merge_drops(report: SourceReport, reason: str, where: str, detail: str) -> None:
    report.dropped[reason] = report.dropped.get(reason, 0) + 1
    examples = report.examples.setdefault(reason, [])
    if len(examples) < EXAMPLES_PER_REASON:
        examples.append(f"{where}: {detail}")


# ----------------------------------------------------------------------------------------------
# building


def row_lengths(dataset) -> list[int]:
    """The token count of every row of ``dataset``: its ``length`` column, which the pipeline writes
    (reading it avoids decoding every ``input_ids`` row), else the rows' own lengths."""
    if "length" in getattr(dataset, "column_names", ()):
        return [int(length) for length in dataset["length"]]
    return [len(ids) for ids in dataset["input_ids"]]


def _features():
    import datasets

    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "length": datasets.Value("int32"),
            "supervised": datasets.Value("int32"),
            "truncated": datasets.Value("bool"),
            "method": datasets.Value("string"),
            "boundary": datasets.Value("int32"),
            "failure": datasets.Value("string"),
        }
    )


def _encode_batch(batch: dict, tokenizer, max_length: int, rendering: Rendering, info) -> dict:
    results = rendering.encode(tokenizer, batch["messages"], max_length, info)
    columns: dict[str, list] = {name: [] for name in _features()}
    for identifier, result in zip(batch["id"], results):
        failed = isinstance(result, EncodeFailure)
        columns["id"].append(identifier)
        columns["input_ids"].append([] if failed else result.input_ids)
        columns["loss_mask"].append([] if failed else result.loss_mask)
        columns["length"].append(0 if failed else len(result.input_ids))
        columns["supervised"].append(0 if failed else sum(result.loss_mask))
        columns["truncated"].append(False if failed else result.truncated)
        columns["method"].append("" if failed else result.method)
        columns["boundary"].append(0 if failed else result.boundary_tokens)
        columns["failure"].append(f"{result.reason}\t{result.detail}" if failed else "")
    return columns


def _encode(
    data: DataConfig, tokenizer, rendering: Rendering, key: str, source_report: SourceReport, conversations
):
    """Tokenise with ``datasets.map``; returns (kept dataset, partial report fields)."""
    import datasets

    info = rendering.probe(tokenizer)
    table = datasets.Dataset.from_dict(
        {"id": [c.id for c in conversations], "messages": [c.messages for c in conversations]}
    )
    encoded = table.map(
        _encode_batch,
        batched=True,
        batch_size=ENCODE_BATCH,
        remove_columns=["messages"],
        features=_features(),
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_length": data.max_length,
            "rendering": rendering,
            "info": info,
        },
        new_fingerprint=f"{key}-encode",  # hashing a tokenizer for datasets' fingerprint is slow
        desc="tokenising",
    )
    statistics = encoded.select_columns(
        ["id", "length", "supervised", "truncated", "method", "boundary", "failure"]
    )
    columns = statistics.to_dict()
    kept = []
    for index, (identifier, failure, supervised) in enumerate(
        zip(columns["id"], columns["failure"], columns["supervised"])
    ):
        if failure:
            reason, detail = failure.split("\t", 1)
            _merge_drops(source_report, reason, f"id {identifier}", detail)
        elif supervised == 0:
            detail = f"no assistant token within the first {data.max_length} tokens"
            _merge_drops(source_report, LENGTH_DROP, f"id {identifier}", detail)
        else:
            kept.append(index)
    methods: dict[str, int] = {}
    for index in kept:
        methods[columns["method"][index]] = methods.get(columns["method"][index], 0) + 1
    lengths = [columns["length"][i] for i in kept]
    stats = {
        "truncated_examples": sum(columns["truncated"][i] for i in kept),
        "tokens": sum(lengths),
        "assistant_tokens": sum(columns["supervised"][i] for i in kept),
        "mask_methods": methods,
        "boundary_tokens": sum(columns["boundary"][i] for i in kept),
        "length_histogram": length_histogram(lengths, data.max_length),
        "template_end_of_turn": info.end_of_turn if info is not None else "",
        "template": rendering.name,
    }
    result = encoded.select(kept).select_columns(["input_ids", "loss_mask", "length", "id"])
    return result, stats


def _split(dataset, data: DataConfig, held_out: bool = True):
    """Deterministic train/validation split: a seeded shuffle of the kept examples (with
    ``held_out`` False, every example in source order for training and an empty validation split)."""
    if not held_out:
        return dataset, dataset.select([])
    if data.validation_size >= len(dataset):
        raise DataError(
            f"data.validation_size={data.validation_size} leaves no training examples out of "
            f"{len(dataset)} kept; lower data.validation_size or raise data.limit"
        )
    parts = dataset.train_test_split(test_size=data.validation_size, seed=data.seed, shuffle=True)
    return parts["train"], parts["test"]


def _load_cached(path: Path):
    import datasets

    report = DataReport.from_json((path / "report.json").read_text())
    train = datasets.load_from_disk(str(path / "train"))
    # An extra source's entry holds no validation split (datasets cannot save an empty one).
    validation = (
        datasets.load_from_disk(str(path / "validation"))
        if (path / "validation").is_dir()
        else train.select([])
    )
    return train, validation, report


def load_cache_entry(path: Path):
    """``(train, validation, report)`` stored at ``path``, or None when there is no usable entry.

    Entries are renamed into place only when complete, so a directory without ``report.json`` or
    one that does not load (a disk error, a copy cut short, a writer from an older version) is
    discarded with a warning, and the caller rebuilds it.
    """
    if not path.exists():
        return None
    if not (path / "report.json").is_file():
        problem = "is incomplete (no report.json)"
    else:
        try:
            return _load_cached(path)
        except Exception as error:  # noqa: BLE001 - datasets and pyarrow raise many types for damaged files
            problem = f"is unreadable ({type(error).__name__}: {error})"
    # stacklevel: the warning points at build_datasets' caller (through _build_source)
    warnings.warn(f"datasets cache entry {path} {problem}; removing it and building again", stacklevel=4)
    shutil.rmtree(path, ignore_errors=True)
    return None


def save_cache_entry(path: Path, train, validation, report: DataReport) -> None:
    """Write the entry to a temporary sibling, check it loads, then rename it into place: an
    interrupted or failed build never leaves something that looks like a cache hit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".tmp-"))
    try:
        train.save_to_disk(str(staging / "train"))
        if len(validation):
            validation.save_to_disk(str(staging / "validation"))
        (staging / "report.json").write_text(report.to_json())
        _load_cached(staging)
        os.replace(staging, path)
    except OSError:
        if not (path / "report.json").is_file():  # not a concurrent build that finished first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_datasets(data: DataConfig, tokenizer, base_name: str):
    """Build (or load from cache) the train and validation datasets.

    Args:
        data: source, split, skip and limit (usable conversations skip to skip + limit), max_length,
            validation_size, seed, cache_dir, max_drop_fraction (more records dropped than this
            share: ``DataError``), extra_sources (every kept example of each joins the training
            split, after the source's).
        tokenizer: the base model's fast tokenizer; its chat template formats the conversations,
            or plain text does (``data.template``, ``draftheads.data.rendering``).
        base_name: the base model reference, used to name the cache entry.

    Returns:
        ``(train, validation, report)``: ``datasets.Dataset`` with rows input_ids, loss_mask,
        length, id; and a ``DataReport``.
    """
    data.validate()
    rendering = resolve_rendering(data.template, tokenizer)
    train, validation, report = _build_source(data, tokenizer, rendering, base_name, held_out=True)
    if not data.extra_sources:
        return train, validation, report
    import datasets

    parts = [train]
    held_out_ids = set(validation["id"])
    for index, source in enumerate(data.extra_sources):
        # Every conversation of an extra source, in source order, encoded as data.source's are.
        extra = dataclasses.replace(data, source=source, skip=0, limit=None, extra_sources=())
        try:
            rows, _, extra_report = _build_source(extra, tokenizer, rendering, base_name, held_out=False)
        except DataError as error:
            raise DataError(f"data.extra_sources[{index}]: {error}") from None
        dropped = dict(extra_report.dropped)
        # Another answer to a held-out conversation (the same source distilled otherwise) would
        # leak its prompt into training: such rows are left out, and counted.
        kept = [position for position, identifier in enumerate(rows["id"]) if identifier not in held_out_ids]
        if len(kept) < len(rows):
            dropped[HELD_OUT_DROP] = len(rows) - len(kept)
            rows = rows.select(kept)
        tokens = sum(rows["length"])
        assistant_tokens = sum(sum(mask) for mask in rows["loss_mask"])
        parts.append(rows)
        report.extra_sources.append(
            {
                "source": extra_report.source,
                "conversations_read": extra_report.conversations_read,
                "examples": len(rows),
                "tokens": tokens,
                "assistant_tokens": assistant_tokens,
                "dropped": dropped,
            }
        )
        report.seconds += extra_report.seconds
        report.tokens += tokens
        report.assistant_tokens += assistant_tokens
    train = datasets.concatenate_datasets(parts)
    report.examples += len(train) - report.train_examples
    report.train_examples = len(train)
    return train, validation, report


def _build_source(data: DataConfig, tokenizer, rendering: Rendering, base_name: str, held_out: bool):
    """``build_datasets`` for ``data.source`` alone; with ``held_out`` False, every kept example
    goes to the training split (an extra source)."""
    start = time.perf_counter()
    # A Hub dataset is keyed by, and read at, the commit its revision names now.
    data = dataclasses.replace(data, source=pinned_source(data.source))
    key = cache_key(data, tokenizer, rendering) + ("" if held_out else "-all")
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{Path(base_name).name}-{Path(data.source).name}")[:60]
    path = dataset_cache_root(data) / f"{label}-{key}"
    cached = load_cache_entry(path)
    if cached is not None:
        train, validation, report = cached
        check_drop_share(
            report.source,
            report.conversations_read,
            report.dropped,
            report.drop_examples,
            data.max_drop_fraction,
        )
        report.cache_hit, report.seconds, report.cache_path = True, time.perf_counter() - start, str(path)
        return train, validation, report

    read_limit = None if data.limit is None else data.skip + data.limit
    conversations, source_report = read_conversations(data.source, data.split, read_limit)
    if data.skip and len(conversations) <= data.skip:
        raise DataError(
            f"data.skip is {data.skip}, but '{data.source}' has {len(conversations)} usable "
            "conversations: nothing is left to train on"
        )
    conversations = conversations[data.skip :]
    # Checked before tokenising too, so a wrong file fails fast.
    check_drop_share(
        source_report.source,
        source_report.records,
        source_report.dropped,
        source_report.examples,
        data.max_drop_fraction,
    )
    if not conversations:
        raise DataError(
            f"data source '{data.source}' gave no usable conversation; dropped: {source_report.dropped}"
        )
    examples, stats = _encode(data, tokenizer, rendering, key, source_report, conversations)
    if len(examples) == 0:
        raise DataError(f"no example kept from '{data.source}'; dropped: {source_report.dropped}")
    train, validation = _split(examples, data, held_out)
    report = DataReport(
        source=source_report.source,
        conversations_read=source_report.records,
        conversations_valid=len(conversations),  # after data.skip
        examples=len(examples),
        train_examples=len(train),
        validation_examples=len(validation),
        dropped=source_report.dropped,
        drop_examples=source_report.examples,
        repairs=source_report.repairs,
        truncated_tail=source_report.truncated_tail,
        max_length=data.max_length,
        **stats,
    )
    # Cached even when too much is dropped: a rerun with a higher max_drop_fraction is then instant.
    save_cache_entry(path, train, validation, report)
    check_drop_share(
        report.source, report.conversations_read, report.dropped, report.drop_examples, data.max_drop_fraction
    )
    train, validation, _ = _load_cached(path)
    report.seconds, report.cache_path = time.perf_counter() - start, str(path)
    return train, validation, report
