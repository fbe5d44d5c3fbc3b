"""``draftheads distill``: regenerate every assistant turn with the base model (self-distillation).

Draft heads learn to predict the base model, so training them on the base model's own answers
instead of ShareGPT's (ChatGPT's) answers raises acceptance (Medusa-2 paper, section 2.3.2; EAGLE-3
trains on regenerated data too). Conversations are answered turn by turn: the k-th answer is
generated from the conversation so far with the model's own earlier answers, batched across
conversations with left padding. Each finished conversation is appended to a ShareGPT-form JSONL
file and flushed, so a re-run skips every id already written (the file is resumable) and the file
is a local ``.jsonl`` source for the data pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from draftheads.config import DistillConfig
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

    def finished(self) -> dict:
        """The ShareGPT-form record, ending at the last regenerated answer."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        turns = [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"]} for m in self.done]
        return {"id": self.conversation.id, "conversations": turns}


def written_ids(path: Path) -> set[str]:
    """Ids already in the output file; a partial last line (an interrupted write) is cut off."""
    if not path.is_file():
        return set()
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        print(f"[distill] {path}: dropping an incomplete last line ({len(raw) - keep} bytes)")
        with open(path, "r+b") as stream:
            stream.truncate(keep)
        raw = raw[:keep]
    ids = set()
    for line in raw.decode("utf-8").splitlines():
        if line.strip():
            ids.add(str(json.loads(line)["id"]))
    return ids


def generate_answers(model, tokenizer, texts: list[str], config: DistillConfig) -> list[str]:
    """One assistant answer per rendered prompt (chat template + generation prompt), batched and
    left-padded."""
    import torch

    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    sampling = (
        {"do_sample": True, "temperature": config.temperature}
        if config.temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        output = model.generate(
            **batch,
            max_new_tokens=config.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            top_p=None,
            top_k=None,
            **sampling,
        )  # (B, T + new)
    new_tokens = output[:, batch["input_ids"].shape[1] :]  # (B, new)
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new_tokens]


def distill(
    model,
    tokenizer,
    conversations: list[Conversation],
    out: Path,
    config: DistillConfig,
    max_length: int | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Regenerate and append ``conversations`` not yet in ``out``; returns counts.

    A conversation stops at the first turn whose prompt + ``max_new_tokens`` exceeds
    ``max_length`` (training truncates examples there, so later turns would never be trained on)
    or the model's context.
    """
    from tqdm import tqdm

    done_ids = written_ids(out)
    pending = [c for c in conversations if c.id not in done_ids]
    limits = [getattr(model.config, "max_position_embeddings", None), max_length]
    context = min((limit for limit in limits if limit), default=None)
    counts = {"written": 0, "skipped_existing": len(conversations) - len(pending), "cut_at_length": 0}
    # Similar lengths in one batch waste less left padding; the output order does not matter (ids).
    pending.sort(key=lambda c: sum(len(m["content"]) for m in c.messages))
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    turns = sum(m["role"] == "assistant" for c in pending for m in c.messages)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=turns, unit="turn", desc="distill", disable=not progress)
    with open(out, "a", encoding="utf-8") as stream:
        for first in range(0, len(pending), config.batch_size):
            active = [DistillState(c) for c in pending[first : first + config.batch_size]]
            while active:
                texts, still = [], []
                for state in active:
                    prompt = state.next_prompt()
                    if prompt is not None:
                        text = tokenizer.apply_chat_template(
                            prompt, tokenize=False, add_generation_prompt=True
                        )
                        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
                        if context is not None and length + config.max_new_tokens > context:
                            counts["cut_at_length"] += 1
                            bar.update(
                                sum(
                                    m["role"] == "assistant"
                                    for m in state.conversation.messages[state.position :]
                                )
                            )
                            prompt = None
                    if prompt is None:
                        record = state.finished()
                        if record["conversations"]:
                            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                            stream.flush()
                            counts["written"] += 1
                        continue
                    texts.append(text)
                    still.append(state)
                if still:
                    for state, answer in zip(still, generate_answers(model, tokenizer, texts, config)):
                        state.answer(answer)
                    bar.update(len(still))
                    bar.set_postfix(written=counts["written"])
                active = still
    bar.close()
    return counts
