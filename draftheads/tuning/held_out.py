"""Held-out prompts and the base model's greedy continuations of them: the text tuning measures on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftheads.data.sources import DataError, ReadFailure, read_lines
from draftheads.prompt_format import DEFAULT_TEMPLATE, choose_template, prompt_ids


def held_out_prompts(
    source: str, skip: int, count: int, tokenizer, max_prompt_tokens: int, template: str = DEFAULT_TEMPLATE
) -> list[torch.Tensor]:
    """First user turns rendered by ``template`` (auto | chat | plain, ``draftheads.prompt_format``;
    refused as ``--template``): from eval prompts (mt-bench, humaneval) or from any conversation
    source, after skipping ``skip`` items (keep them out of the training data)."""
    from draftheads.data.prompts import EMBEDDED, load_prompts
    from draftheads.data.sources import read_conversations

    if source in EMBEDDED or _is_prompt_file(source):
        texts = [prompt.turns[0] for prompt in load_prompts(source)[skip:]]
    else:
        # Extra conversations in reserve for prompts that turn out too long.
        conversations, _ = read_conversations(source, limit=skip + 4 * count)
        texts = [
            next(m["content"] for m in c.messages if m["role"] == "user")
            for c in conversations[skip:]
            if any(m["role"] == "user" for m in c.messages)
        ]
    chosen = choose_template(template, tokenizer, "--template")
    prompts = []
    for text in texts:
        ids = prompt_ids(tokenizer, [{"role": "user", "content": text}], chosen)
        if len(ids) <= max_prompt_tokens:
            prompts.append(torch.tensor(ids, dtype=torch.long))
        if len(prompts) == count:
            break
    if not prompts:
        raise DataError(
            f"{source}: none of the {len(texts)} prompts after skipping {skip} has at most "
            f"{max_prompt_tokens} tokens; skip fewer or allow longer prompts"
        )
    return prompts


def _is_prompt_file(source: str) -> bool:
    """A .jsonl (or .jsonl.gz) of prompts (``turns`` or ``prompt``, as bench reads) rather than of
    conversations."""
    path = Path(source)
    if not path.name.endswith((".jsonl", ".jsonl.gz")) or not path.is_file():
        return False
    lines = (line for _, line in read_lines(path) if isinstance(line, ReadFailure) or line.strip())
    first = next(lines, "{}")
    if isinstance(first, ReadFailure):
        return False  # read as conversations, whose reader names the bad byte
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and ("turns" in record or "prompt" in record)


def greedy_continuations(
    generator,
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    progress: bool = True,
    stop: tuple[str, ...] = (),
):
    """((T,) prompt + greedy continuation, prompt length) per prompt, each ending at a ``stop``
    string (the rendering's: ``prompt_format.stop_strings``) if it meets one. Decoded with the head
    itself (lossless, so the tokens are the base's greedy ones; any float disagreement is caught
    later, where only positions whose path is the base's own greedy path are judged)."""
    from tqdm.auto import tqdm

    sequences = []
    for prompt in tqdm(prompts, desc="continuations", unit="prompt", disable=not progress):
        result = generator.generate(prompt, max_new_tokens=max_new_tokens, stop=stop)
        sequences.append((result.sequences[0], result.prompt_length))
    return sequences
