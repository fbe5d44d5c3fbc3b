"""A JSON-lines file that a command appends records to and continues after an interruption.

``draftheads distill`` and ``draftheads synth-prompts`` write one JSON object a line to ``--out``
and flush after each, so a re-run reads what is there and skips it. Before continuing a file they
check it is their own output (a foreign file is refused unchanged, naming the line) and only then
cut off a last line that an interrupted write left incomplete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from draftheads.data.sources import DataError, describe_json_error

RECORD_START = b'{"id": '  # how every record distill and synth-prompts write begins (json.dumps)


def _excerpt(line: bytes) -> str:
    """The start of a line, for an error message."""
    text = line.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _parse_record(line: bytes, problem: Callable[[dict], str | None]) -> tuple[dict | None, str | None]:
    """``(record, None)`` for a line holding a record ``problem`` accepts, else ``(None, what is wrong)``."""
    try:
        record = json.loads(line.decode("utf-8-sig"))  # -sig: a byte-order mark is no record's
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 text (byte {error.start} of the line)"
    except json.JSONDecodeError as error:
        return None, f"not JSON ({describe_json_error(error)}): {_excerpt(line)}"
    if not isinstance(record, dict):
        return None, f"not a JSON object but {type(record).__name__}"
    wrong = problem(record)
    return (None, wrong) if wrong else (record, None)


def read_output_records(path: Path, problem: Callable[[dict], str | None], command: str) -> list[dict]:
    """The records of a JSONL file that ``command`` appends to (``--out``), in order.

    Each complete line must be a JSON object that ``problem`` finds nothing wrong with (it returns
    what is wrong, or None), and a last line without a newline must be such a record too or begin as
    every record written does; otherwise the file is not this command's output and a DataError names
    the file, the line and what is wrong, before anything is changed. Only then is that partial last
    line (a write that was interrupted) cut off.
    """
    if path.exists() and not path.is_file():
        raise DataError(f"{path}: not a file; give --out a file path ({command} writes JSON lines)")
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")  # not splitlines: answers may hold a raw U+2028
    partial = lines.pop()  # b"" when the file ends with a newline
    refuse = f"; {command} continues only a file it wrote: give another --out"
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            record, wrong = _parse_record(line, problem)
            if wrong:
                raise DataError(f"{path} line {number}: {wrong}{refuse}")
            records.append(record)
    if partial:
        try:
            json.loads(partial.decode("utf-8-sig"))
        except ValueError:  # cut short (a JSONDecodeError or a UnicodeDecodeError)
            wrong = None
            if partial.strip() and not (partial.startswith(RECORD_START) or RECORD_START.startswith(partial)):
                wrong = f"not the start of a record: {_excerpt(partial)}"
        else:  # a whole line but for its newline: it must be a record like the others
            _, wrong = _parse_record(partial, problem)
        if wrong:
            raise DataError(f"{path} line {len(lines) + 1} (no newline at its end): {wrong}{refuse}")
        print(f"[{command}] {path}: dropping an incomplete last line ({len(partial)} bytes)")
        with open(path, "r+b") as stream:
            stream.truncate(len(raw) - len(partial))
    return records
