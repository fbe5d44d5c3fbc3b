"""User prompts written by the base model itself, for distillation data that looks like what users ask.

A chat model that has been tuned on conversations has learned what a user turn looks like. Given
only its chat template up to the point where a user's text begins (the "pre-query template") and
sampled at temperature 1, it writes a user request (Xu et al. 2024, "Magpie: Alignment Data Synthesis
from Scratch by Prompting Aligned LLMs with Nothing", arXiv 2406.08464). Answering those requests
greedily with the same model (``draftheads distill --prompts``) gives a head training data whose
prompts come from the model's own picture of a chat, not from one website's logs.

``synthesize`` samples prompts in batches and keeps those that end with the end-of-turn token within
``max_new_tokens`` and are not empty or a repeat (case and whitespace folded) of one kept before.
Each batch is sampled under its own seed (``seed + batch index``), so an interrupted run continued on
the same file writes the prompts a single run would have written. Kept prompts are appended to a
JSONL file of ``{"id", "turns", "category"}`` records, the form ``draftheads.data.prompts`` reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftheads.data.output_records import read_output_records
from draftheads.data.sources import DataError

SENTINEL = "\u2063draftheads-user-text\u2063"  # content no template alters; where the user's text begins
CATEGORY = "self"  # the category the prompts carry in the prompts file
BARREN_BATCHES = 20  # batches in a row keeping nothing before a run gives up (a model never ending its turn)
Sample = Callable[[list[int], int, int], list[list[int]]]  # (prefix ids, rows, seed) -> new ids per row


@dataclass(frozen=True)
class SynthSettings:
    """How prompts are sampled (defaults as Magpie's: temperature 1, no top-p or top-k cut)."""

    count: int = 1000  # prompts to have in the file when done
    batch_size: int = 32  # prompts sampled together (one seed per batch)
    temperature: float = 1.0
    max_new_tokens: int = 128  # a request still open after this many tokens is dropped
    seed: int = 0
    system: str | None = None  # a system prompt; None: the chat template's own default

    def validate(self) -> None:
        for name in ("count", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise DataError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise DataError(
                f"temperature must be > 0 (greedy sampling writes one prompt), got {self.temperature}"
            )


def pre_query_ids(tokenizer, system: str | None = None) -> list[int]:
    """The chat template's tokens up to where a user turn's text begins."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": SENTINEL})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if text.count(SENTINEL) != 1:
        raise DataError(
            "the tokenizer's chat template does not render a user turn's text verbatim "
            "once, so the text before it cannot be cut out"
        )
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


def fold(text: str) -> str:
    """The form two prompts are compared in: case and runs of whitespace folded."""
    return re.sub(r"\s+", " ", text).strip().casefold()


@dataclass
class SynthCounts:
    """What a run did: prompts kept, dropped by reason, tokens sampled."""

    existing: int = 0
    kept: int = 0
    sampled: int = 0
    new_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def judge(new_ids: list[int], end_ids: set[int], tokenizer) -> tuple[str | None, str, int]:
    """``(text, "", tokens)`` for a usable sample, or ``(None, reason, tokens)``: ``unfinished`` (no
    end-of-turn token: cut by ``max_new_tokens``) or ``empty``. ``tokens``: those sampled up to the
    end-of-turn token (padding after it not counted)."""
    end = next((i for i, t in enumerate(new_ids) if t in end_ids), None)
    if end is None:
        return None, "unfinished", len(new_ids)
    text = tokenizer.decode(new_ids[:end], skip_special_tokens=True).strip()
    return (text, "", end + 1) if text else (None, "empty", end + 1)


def _prompt_problem(record: dict) -> str | None:
    if "turns" not in record:
        return f"no 'turns' (keys: {sorted(record)})"
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        return f"'turns' must be a non-empty list of non-empty strings, got {turns!r:.80}"
    return None


def read_existing(path: Path) -> list[dict]:
    """The prompts records already in ``path`` (``read_output_records``: a file that is not a
    prompts file is refused unchanged; a partial last line is cut off)."""
    return read_output_records(path, _prompt_problem, "synth-prompts")


def synthesize(
    sample: Sample,
    tokenizer,
    out: Path,
    settings: SynthSettings,
    progress: Callable[[int], None] = lambda kept: None,
) -> SynthCounts:
    """Append prompts to ``out`` until it holds ``settings.count``; ``sample(prefix, rows, seed)``
    returns each row's sampled token ids (an engine: ``hf_sampler`` or the vLLM server's)."""
    import time

    settings.validate()
    started = time.perf_counter()
    prefix = pre_query_ids(tokenizer, settings.system)
    end_ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        end_ids.add(im_end)
    records = read_existing(out)
    existing, seen = len(records), {fold(record["turns"][0]) for record in records}
    counts = SynthCounts(existing=existing)
    # batches already spent: a continued run resumes the seed sequence where the file stands
    batch = _batches_spent(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    barren = 0
    with open(out, "a", encoding="utf-8") as stream:
        while existing + counts.kept < settings.count:
            if barren == BARREN_BATCHES:
                raise DataError(
                    f"the last {barren} batches of {settings.batch_size} kept no prompt "
                    f"(dropped so far: {counts.dropped}); raise --max-new-tokens if they are "
                    "'unfinished', or check that the base is a chat model that ends its turns"
                )
            kept_before = counts.kept
            rows = sample(prefix, settings.batch_size, settings.seed + batch)
            for row, new_ids in enumerate(rows):
                counts.sampled += 1
                text, reason, tokens = judge(new_ids, end_ids, tokenizer)
                counts.new_tokens += tokens
                if text is not None and fold(text) in seen:
                    text, reason = None, "duplicate"
                if text is None:
                    counts.drop(reason)
                    continue
                if existing + counts.kept >= settings.count:
                    break
                seen.add(fold(text))
                record = {"id": f"self-{settings.seed}-{batch}-{row}", "turns": [text], "category": CATEGORY}
                stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                counts.kept += 1
            stream.flush()
            barren = barren + 1 if counts.kept == kept_before else 0
            batch += 1
            progress(existing + counts.kept)
    counts.seconds = time.perf_counter() - started
    return counts


def _batches_spent(records: list[dict]) -> int:
    """One past the highest batch index in the records' ids (``self-SEED-BATCH-ROW``)."""
    last = -1
    for record in records:
        parts = str(record.get("id", "")).split("-")
        if len(parts) == 4 and parts[0] == "self" and parts[2].isdigit():
            last = max(last, int(parts[2]))
    return last + 1


def hf_sampler(model, settings: SynthSettings) -> Sample:
    """Sampling with ``model.generate`` in this process: every row starts from the same prefix, so
    a batch needs no padding."""
    import torch

    def sample(prefix: list[int], rows: int, seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        ids = torch.tensor([prefix] * rows, device=model.device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=settings.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=settings.max_new_tokens,
                pad_token_id=model.generation_config.eos_token_id
                if model.generation_config.pad_token_id is None
                else model.generation_config.pad_token_id,
            )
        return [row[len(prefix) :].tolist() for row in out]

    return sample


def server_sampler(url: str, model_id: str, settings: SynthSettings, in_flight: int) -> Sample:
    """Sampling through an OpenAI-compatible server's ``/v1/completions`` (vLLM): one request per
    row, seeded ``seed * rows + row``, up to ``in_flight`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    from draftheads.data.distill_vllm import REQUEST_TIMEOUT_S, completion_body
    from draftheads.serving.vllm import request_json

    def one(prefix: list[int], seed: int) -> list[int]:
        body = completion_body(model_id, prefix, settings.max_new_tokens, settings.temperature, seed)
        choice = request_json(url, "/v1/completions", body, REQUEST_TIMEOUT_S)["choices"][0]
        return list(choice.get("token_ids") or [])

    def sample(prefix: list[int], rows: int, seed: int) -> list[list[int]]:
        with ThreadPoolExecutor(min(rows, in_flight)) as pool:
            return list(pool.map(lambda row: one(prefix, seed * rows + row), range(rows)))

    return sample
