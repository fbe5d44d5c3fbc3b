"""ShareGPT's later user turns as standalone prompts: the requests the corpus never answered.

The shipped corpus (``smollm2-sharegpt``) answers a conversation's user turns in order and stops at
the first turn whose prompt + 256 new tokens would not fit a 512-token window, so of the packaged
ShareGPT's 61,413 user turns it answers 19,341. The others are distinct requests a head has
never seen. This script writes them as single-turn prompts (``{"id", "turns", "category"}`` per
line, what ``draftheads distill --prompts`` reads), each to be answered without its conversation:

- every user turn after the first whose conversation the corpus answered fewer turns of
  (turns it answered in context are skipped);
- not from the conversations held out by the corpus runs (``--held-out``, one id per line), so
  their held-out scores stay clean;
- at least ``--min-chars`` characters after stripping (short follow-ups such as "continue" or
  "more" say nothing on their own);
- at most ``--max-prompt-tokens`` tokens under the base's chat template (system prompt
  included), so that 256 new tokens fit the corpus's 512-token window and distillation drops none;
- the first of any repeats (case and whitespace folded), first turns of the source included.

Ids are ``<conversation id>:<turn index>`` (the user turn's index, 0 = first). Run from the
repository root:

    python scripts/later_turns.py OUT.jsonl --held-out HELD_OUT_IDS.txt
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftheads.base_model import load_tokenizer
from draftheads.data.sources import read_conversations

CORPUS = Path("docs/results/corpus/smollm2-sharegpt")


def answered_turns(corpus: Path) -> dict[str, int]:
    """Conversation id -> user turns the corpus answered (its chunks read and checked as training does)."""
    conversations, _ = read_conversations(str(corpus))
    return {c.id: sum(1 for m in c.messages if m["role"] == "user") for c in conversations}


def folded(text: str) -> str:
    return " ".join(text.lower().split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--held-out", type=Path, required=True, help="held-out conversation ids, one a line")
    parser.add_argument("--min-chars", type=int, default=40)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--base", default="smollm2-135m-instruct")
    args = parser.parse_args()

    held_out = set(args.held_out.read_text().split())
    answered = answered_turns(CORPUS)
    tokenizer = load_tokenizer(args.base)
    conversations, _ = read_conversations("sharegpt")
    seen = {folded(m["content"]) for c in conversations for m in c.messages[:1] if m["role"] == "user"}
    counts = dict.fromkeys(["later turns", "held out", "answered in context", "short", "long", "repeat"], 0)
    kept = []
    for conversation in conversations:
        turns = [m["content"] for m in conversation.messages if m["role"] == "user"]
        for index, turn in enumerate(turns[1:], start=1):
            counts["later turns"] += 1
            text = turn.strip()
            if conversation.id in held_out:
                counts["held out"] += 1
            elif index < answered.get(conversation.id, 0):
                counts["answered in context"] += 1
            elif len(text) < args.min_chars:
                counts["short"] += 1
            elif folded(text) in seen:
                counts["repeat"] += 1
            else:
                messages = [{"role": "user", "content": text}]
                length = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
                if length > args.max_prompt_tokens:
                    counts["long"] += 1
                    continue
                seen.add(folded(text))
                kept.append(
                    {"id": f"{conversation.id}:{index}", "turns": [text], "category": "sharegpt-later"}
                )
    with args.out.open("w", encoding="utf-8") as out:
        for prompt in kept:
            out.write(json.dumps(prompt, ensure_ascii=False) + "\n")
    print(f"kept {len(kept):,} of " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
