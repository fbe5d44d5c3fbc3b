"""``draftheads distill``: regenerate every assistant turn with the base model (self-distillation).

Draft heads learn to predict the base model, so training them on the base model's own answers
instead of ShareGPT's (ChatGPT's) answers raises acceptance (Medusa-2 paper, section 2.3.2; EAGLE-3
trains on regenerated data too). Conversations are answered turn by turn: the k-th answer is
generated from the conversation so far with the model's own earlier answers.

A ``TurnQueue`` hands out the turns to answer as token ids and takes the answers back; an engine
drains it with as many turns in flight as it can hold: the in-process continuous batcher
(``draftheads.data.distill_hf``) or an OpenAI-compatible server (``draftheads.data.distill_vllm``).
Each finished conversation is appended to a ShareGPT-form JSONL file and flushed, so a re-run skips
every id already written (the file is resumable) and the file is a local ``.jsonl`` source for the
data pipeline.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftheads.config import DataConfig, DistillConfig
from draftheads.data.output_records import read_output_records
from draftheads.data.prompts import Prompt
from draftheads.data.rendering import Rendering, resolve_rendering
from draftheads.data.sources import Conversation

SHAREGPT_SPEAKERS = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclass
class DistillState:
    """One conversation being regenerated: the messages so far and what is left to answer."""

    conversation: Conversation
    done: list[dict[str, str]] = field(default_factory=list)  # messages with regenerated answers
    position: int = 0  # next index into conversation.messages

    def next_prompt(self) -> list[dict[str, str]] | None:
        """Advance to the next assistant turn; the messages before it, or None when finished."""
        messages = self.conversation.messages
        while self.position < len(messages) and messages[self.position]["role"] != "assistant":
            self.done.append(dict(messages[self.position]))
            self.position += 1
        if self.position == len(messages):
            return None
        return list(self.done)

    def answer(self, text: str) -> None:
        self.done.append({"role": "assistant", "content": text})
        self.position += 1

    def turns_left(self) -> int:
        return sum(m["role"] == "assistant" for m in self.conversation.messages[self.position :])

    def finished(self) -> dict:
        """The ShareGPT-form record, ending at the last regenerated answer."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        turns = [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"]} for m in self.done]
        return {"id": self.conversation.id, "conversations": turns}


def conversations_from_prompts(prompts: list[Prompt]) -> list[Conversation]:
    """Prompts (``draftheads.data.prompts``: user turns only) as conversations to distill: each user
    turn followed by the assistant turn to generate. Those assistant turns are empty and never read:
    ``DistillState`` regenerates every assistant turn."""
    conversations = []
    for prompt in prompts:
        messages = []
        for turn in prompt.turns:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        conversations.append(Conversation(id=prompt.id, messages=messages))
    return conversations


def _distilled_problem(record: dict) -> str | None:
    if "id" not in record:
        return f"no 'id' (keys: {sorted(record)})"
    if not isinstance(record.get("conversations"), list):
        return f"no 'conversations' list (keys: {sorted(record)})"
    return None


def written_ids(path: Path) -> set[str]:
    """Ids already in the output file (``read_output_records``: a file that is not distill's own
    output is refused unchanged; a partial last line is cut off)."""
    return {str(record["id"]) for record in read_output_records(path, _distilled_problem, "distill")}


@dataclass(frozen=True)
class Turn:
    """One assistant turn to generate: ``prompt_ids`` is the conversation so far, rendered with
    the generation prompt (``draftheads.data.rendering``); ``key`` names it when its answer comes back."""

    key: int
    prompt_ids: list[int]


@dataclass
class DistillCounts:
    """What a distillation did; ``tokens_per_second`` counts generated tokens over the wall time."""

    written: int = 0
    skipped_existing: int = 0
    cut_at_length: int = 0
    answers: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class TurnQueue:
    """Conversations in, turns out, answers back, records written.

    ``take()`` returns the next turn to answer (a follow-up turn of a conversation already started
    first, so few conversations are open at a time and an interruption loses little), or None when
    nothing is ready: either everything is done, or the remaining turns wait for answers still in
    flight. ``give(key, new_ids)`` records the answer (decoded as ``model.generate``'s text would
    be) and queues the conversation's next turn. Conversations are started shortest first, so
    turns taken together have similar lengths (little padding, similar answer lengths).

    A turn whose prompt + ``max_new_tokens`` would exceed ``context`` ends its conversation there
    (training truncates examples at ``max_length``, so later turns would never be trained on).
    ``rendering`` makes a turn's prompt text and cuts its answer (plain text: at the next turn).
    """

    def __init__(
        self,
        conversations: list[Conversation],
        tokenizer,
        stream,
        max_new_tokens: int,
        context: int | None,
        counts: DistillCounts,
        on_answer: Callable[[int, int], None] = lambda turns, tokens: None,
        rendering: Rendering | None = None,
    ):
        self.tokenizer = tokenizer
        self.rendering = rendering or resolve_rendering(DataConfig().template, tokenizer)
        self.stream = stream
        self.max_new_tokens = max_new_tokens
        self.context = context
        self.counts = counts
        self.on_answer = on_answer  # (turns done, new tokens) for progress reporting
        self.unstarted = deque(
            sorted(conversations, key=lambda c: sum(len(m["content"]) for m in c.messages))
        )
        self.ready: deque[int] = deque()  # keys of started conversations whose next turn can be taken
        self.open: dict[int, DistillState] = {}
        self.next_key = 0

    def take(self) -> Turn | None:
        while self.ready or self.unstarted:
            if self.ready:
                key = self.ready.popleft()
            else:
                key, self.next_key = self.next_key, self.next_key + 1
                self.open[key] = DistillState(self.unstarted.popleft())
            turn = self._turn(key)
            if turn is not None:
                return turn
        return None

    def _turn(self, key: int) -> Turn | None:
        """The conversation's next turn, or None after it is written (finished or cut)."""
        state = self.open[key]
        prompt = state.next_prompt()
        if prompt is not None:
            text = self.rendering.prompt_text(self.tokenizer, prompt)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.context is None or len(ids) + self.max_new_tokens <= self.context:
                self.counts.prompt_tokens += len(ids)
                return Turn(key, ids)
            self.counts.cut_at_length += 1
            self.on_answer(state.turns_left(), 0)
        record = self.open.pop(key).finished()
        if record["conversations"]:
            self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.stream.flush()
            self.counts.written += 1
        return None

    def give(self, key: int, new_ids: list[int]) -> None:
        text = self.rendering.answer_text(self.tokenizer.decode(new_ids, skip_special_tokens=True))
        self.open[key].answer(text)
        self.ready.append(key)
        self.counts.answers += 1
        self.counts.new_tokens += len(new_ids)
        self.on_answer(1, len(new_ids))


def context_limit(model_config, max_length: int | None) -> int | None:
    """The tokens a turn may fill (prompt + answer): the model's context or ``max_length``."""
    limits = [getattr(model_config, "max_position_embeddings", None), max_length]
    return min((limit for limit in limits if limit), default=None)


def distill(
    model,
    tokenizer,
    conversations: list[Conversation],
    out: Path,
    config: DistillConfig,
    max_length: int | None = None,
    progress: bool = True,
    engine: Callable[[TurnQueue], None] | None = None,
    model_config=None,
    rendering: Rendering | None = None,
) -> DistillCounts:
    """Regenerate and append ``conversations`` not yet in ``out``; returns what it did.

    ``engine`` drains the queue (default: ``draftheads.data.distill_hf.ContinuousBatcher`` on
    ``model``); a server engine needs no in-process ``model``, then ``model_config`` (the base's HF
    config) gives the context length. A conversation stops at the first turn whose prompt +
    ``max_new_tokens`` exceeds ``max_length`` or the model's context. ``rendering`` renders the
    turns (None: ``data.template``'s default, resolved for ``tokenizer``).
    """
    from tqdm import tqdm

    if engine is None:
        from draftheads.data.distill_hf import ContinuousBatcher

        engine = ContinuousBatcher(model, tokenizer, config).run
    done_ids = written_ids(out)
    pending = [c for c in conversations if c.id not in done_ids]
    counts = DistillCounts(skipped_existing=len(conversations) - len(pending))
    context = context_limit(model_config if model_config is not None else model.config, max_length)
    turns = sum(m["role"] == "assistant" for c in pending for m in c.messages)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=turns, unit="turn", desc="distill", disable=not progress)
    started = time.perf_counter()

    def on_answer(turns_done: int, new_tokens: int) -> None:
        bar.update(turns_done)
        if new_tokens:
            rate = counts.new_tokens / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(written=counts.written, tokens_per_s=f"{rate:.0f}", refresh=False)

    with open(out, "a", encoding="utf-8") as stream:
        queue = TurnQueue(
            pending, tokenizer, stream, config.max_new_tokens, context, counts, on_answer, rendering
        )
        engine(queue)
    counts.seconds = time.perf_counter() - started
    bar.close()
    return counts
