"""Reading a file of prompts (``draftheads generate --prompts-file``).

Three formats, chosen by the file's suffix in any case, else by its content:

- JSONL (``.jsonl``, ``.ndjson``): one JSON value a line, a string or an object with a ``prompt``
  string; blank lines are skipped.
- JSON (``.json``): a list of such values; a ``.json`` file that is not one JSON document is read
  as JSONL (a common naming).
- text (any other suffix): one prompt a line, unless the first non-blank line is a JSON object or
  the whole file a JSON list, which are read as above.

Whatever cannot be read raises ``PromptsFileError`` naming ``file:line``.
"""

from __future__ import annotations

import json
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PROMPT_FIELD = "prompt"


class PromptsFileError(ValueError):
    """A prompts file that cannot be read; the message starts with ``file:line``."""


def _prompt_of(value, where: str) -> str:
    """The prompt a JSON value holds: a string, or an object's ``prompt`` string."""
    if isinstance(value, dict) and PROMPT_FIELD in value:
        value = value[PROMPT_FIELD]
        if not isinstance(value, str) or not value:
            raise PromptsFileError(f"{where}: '{PROMPT_FIELD}' must be a non-empty string, got {value!r:.60}")
    if not isinstance(value, str) or not value:
        raise PromptsFileError(
            f"{where}: expected a string or an object with a '{PROMPT_FIELD}' string, got {value!r:.60}"
        )
    return value


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def read_jsonl(path: Path, text: str) -> list[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptsFileError(f"{path}:{number}: not JSON ({err.msg})") from None
        prompts.append(_prompt_of(value, f"{path}:{number}"))
    return prompts


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def read_json_list(path: Path, text: str) -> list[str]:
    """The prompts of a JSON list, each error naming the line its item starts on."""
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        raise PromptsFileError(f"{path}:{_line_of(text, position)}: expected a JSON list of prompts")
    prompts, position = [], _skip_space(text, position + 1)
    if text.startswith("]", position):
        return prompts
    while True:
        start = position
        try:
            value, position = decoder.raw_decode(text, start)
        except json.JSONDecodeError as err:
            raise PromptsFileError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None
        prompts.append(_prompt_of(value, f"{path}:{_line_of(text, start)}"))
        position = _skip_space(text, position)
        if text.startswith("]", position):
            if text[position + 1 :].strip():
                raise PromptsFileError(f"{path}:{_line_of(text, position)}: text after the list")
            return prompts
        if not text.startswith(",", position):
            raise PromptsFileError(f"{path}:{_line_of(text, position)}: expected ',' or ']' in the list")
        position = _skip_space(text, position + 1)


def _looks_like_json(text: str) -> str | None:
    """``json`` for a whole-file JSON list, ``jsonl`` for a first line holding a JSON object, else None."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            return "json" if isinstance(json.loads(stripped), list) else None
        except json.JSONDecodeError:
            return None
    first = stripped.split("\n", 1)[0]
    if first.startswith("{"):
        try:
            return "jsonl" if isinstance(json.loads(first), dict) else None
        except json.JSONDecodeError:
            return None
    return None


def read_prompts_file(path: Path) -> list[str]:
    """The prompts in ``path`` (see the module docstring); raises PromptsFileError naming file:line
    for what it cannot read, FileNotFoundError / IsADirectoryError for no file."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory; give a file of prompts", str(path))
    data = path.read_bytes()  # FileNotFoundError names the file
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise PromptsFileError(
            f"{path}:{_line_of(data.decode('latin-1'), err.start)}: not UTF-8 text"
        ) from None
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        prompts = read_jsonl(path, text)
    elif suffix in JSON_SUFFIXES:
        stripped = text.lstrip()
        prompts = read_json_list(path, text) if stripped.startswith("[") else read_jsonl(path, text)
    else:
        kind = _looks_like_json(text)
        if kind == "json":
            prompts = read_json_list(path, text)
        elif kind == "jsonl":
            prompts = read_jsonl(path, text)
        else:
            prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PromptsFileError(f"{path}:1: no prompts in the file")
    return prompts
