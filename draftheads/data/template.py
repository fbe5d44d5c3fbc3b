"""Tokenising conversations with the base tokenizer's own chat template, plus an assistant-only loss mask.

The mask convention (the same for every template): ``loss_mask[t] = 1`` iff token t lies inside an
assistant turn's content or the template text that closes that turn, up to but excluding trailing
whitespace. For SmolLM2 / ChatML templates that is ``content<|im_end|>`` (the ``\\n`` after
``<|im_end|>`` is not supervised); for Llama-3 it is ``content<|eot_id|>``. The turn header
(``<|im_start|>assistant\\n``, ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``) is what
``add_generation_prompt`` renders and is never supervised, nor are system and user turns.
Supervising the closing token teaches the model (and its draft heads) where answers stop.

Supervised character spans of the rendered text are found by one of three methods, in order:
  generation  the template marks assistant text with ``{% generation %}`` (transformers reports
              its character spans); each span is extended by the closing text found by probing.
  prefix      render(messages[:i], add_generation_prompt=True) and render(messages[:i+1]) are
              prefixes of the full render (the "prefix property"); the assistant span lies between
              their lengths. Holds for SmolLM2, Qwen2 and Llama-3 templates.
  search      templates that break the prefix property (e.g. ones that rewrite earlier turns):
              each assistant content is located in the full render, in order, after the previous
              one, and extended by the probed closing text.
The spans are then mapped to tokens through the tokenizer's character offsets: a token is
supervised iff it lies wholly inside a span. A token straddling a span edge (never seen with the
templates tested) stays unsupervised and is counted in ``boundary_tokens``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from draftheads.prompt_format import TemplateError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
PROBE_USER = "Hello there."
PROBE_ANSWER = "PROBE ANSWER 7"
# Only the first max_length tokens are kept, so long texts are tokenised from a prefix of
# (max_length + TOKEN_MARGIN) * CHARS_PER_TOKEN characters; cutting the text changes only the
# last pre-token or two, far beyond max_length. Too few tokens from a cut text -> encode it all.
TOKEN_MARGIN = 64
CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class TemplateInfo:
    """What a probe of the chat template found once per tokenizer."""

    has_generation_tags: bool
    end_of_turn: str  # text closing an assistant turn, supervised ("<|im_end|>"); "" if unknown
    prefix_property: bool  # the probe conversation renders with the prefix property


@dataclass(frozen=True)
class EncodedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # same length as input_ids; 1 on assistant content + end-of-turn
    method: str  # generation | prefix | search
    truncated: bool  # the rendered conversation had more than max_length tokens
    boundary_tokens: int  # tokens straddling a span edge, left unsupervised


@dataclass(frozen=True)
class EncodeFailure:
    reason: str  # template_error | template_mismatch
    detail: str


def chat_template(tokenizer) -> str:
    template = tokenizer.get_chat_template() if tokenizer.chat_template is not None else None
    if not template:
        name = getattr(tokenizer, "name_or_path", "?")
        raise TemplateError(f"tokenizer '{name}' has no chat template; it cannot build chat training data")
    return template


def require_chat_template(tokenizer, base: str, command: str) -> None:
    """Raise ``TemplateError`` naming ``base`` and what to do when its tokenizer has no chat
    template: ``command`` renders chat turns with it (a base, not an instruct, model has none)."""
    if tokenizer.chat_template:
        return
    raise TemplateError(
        f"base model {base} has no chat template, and {command} renders conversations with it: "
        "give a chat (instruct) model, or add a template to the model's tokenizer "
        "(a chat_template.jinja file in its directory, or 'chat_template' in tokenizer_config.json)"
    )


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def probe_template(tokenizer) -> TemplateInfo:
    """Find the turn-closing text: what follows a probe answer both when the conversation ends
    there and when a user turn follows (their common part, so an end-of-conversation eos that
    some templates add is not taken for the end of every turn), without trailing whitespace."""
    template = chat_template(tokenizer)
    prompt = [{"role": "user", "content": PROBE_USER}]
    answered = prompt + [{"role": "assistant", "content": PROBE_ANSWER}]
    head = render(tokenizer, prompt, add_generation_prompt=True)
    last = render(tokenizer, answered)
    middle = render(tokenizer, answered + [{"role": "user", "content": PROBE_USER}])
    prefix = last.startswith(head) and last[len(head) :].startswith(PROBE_ANSWER)
    after_last = last[last.find(PROBE_ANSWER) + len(PROBE_ANSWER) :] if PROBE_ANSWER in last else ""
    after_middle = middle[middle.find(PROBE_ANSWER) + len(PROBE_ANSWER) :] if PROBE_ANSWER in middle else ""
    return TemplateInfo(
        bool(GENERATION_TAG.search(template)),
        _common_token_prefix(tokenizer, after_last, after_middle),
        prefix,
    )


def _common_token_prefix(tokenizer, first: str, second: str) -> str:
    """The text of the tokens both strings start with, without trailing whitespace (token-wise,
    so "<|im_end|>\n<|im_end|>" and "<|im_end|>\n<|im_start|>" share "<|im_end|>", not "<|im_")."""
    encode = {"add_special_tokens": False, "return_offsets_mapping": True}
    a, b = tokenizer(first, **encode), tokenizer(second, **encode)
    shared = 0
    while (
        shared < min(len(a["input_ids"]), len(b["input_ids"]))
        and a["input_ids"][shared] == b["input_ids"][shared]
    ):
        shared += 1
    return first[: a["offset_mapping"][shared - 1][1]].rstrip() if shared else ""


# ----------------------------------------------------------------------------------------------
# supervised character spans of one rendered conversation


def _extend_by_end_of_turn(
    text: str, spans: list[tuple[int, int]], end_of_turn: str
) -> list[tuple[int, int]]:
    if not end_of_turn:
        return spans
    extended = []
    for start, end in spans:
        if text.startswith(end_of_turn, end) and not text[start:end].endswith(end_of_turn):
            end += len(end_of_turn)
        extended.append((start, end))
    return extended


def _generation_spans(
    tokenizer, messages: list[dict], info: TemplateInfo
) -> tuple[str, list[tuple[int, int]]]:
    # The same renderer apply_chat_template(..., return_assistant_tokens_mask=True) uses; we take its
    # character spans (not its token mask) so every method shares one span -> token mapping.
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[messages],
        chat_template=chat_template(tokenizer),
        return_assistant_tokens_mask=True,
        add_generation_prompt=False,
        **tokenizer.special_tokens_map,
    )
    text = rendered[0]
    return text, _extend_by_end_of_turn(text, [tuple(span) for span in indices[0]], info.end_of_turn)


def _prefix_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]] | None:
    """Spans from rendered-prefix lengths, or None where the template breaks the prefix property."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            return None
        head = render(tokenizer, messages[:index], add_generation_prompt=True)
        turn = text if index == len(messages) - 1 else render(tokenizer, messages[: index + 1])
        if not (text.startswith(turn) and turn.startswith(head)):
            return None
        spans.append((len(head), len(turn.rstrip())))
    return spans


def _search_spans(messages: list[dict], text: str, end_of_turn: str) -> list[tuple[int, int]] | str:
    """Spans found by locating each assistant content in order, or a failure detail."""
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        content = message["content"].strip()  # templates such as Llama-3's trim contents
        if not content:
            if message["role"] == "assistant":
                return f"turn {index}: an empty assistant turn cannot be located without the prefix property"
            continue
        found = text.find(content, cursor)
        if found < 0:
            if message["role"] == "assistant":
                return f"turn {index}: assistant content not found in the rendered text"
            continue  # some templates drop or rewrite system/user turns
        cursor = found + len(content)
        if message["role"] == "assistant":
            spans.append((found, cursor))
    return _extend_by_end_of_turn(text, spans, end_of_turn)


def assistant_spans(
    tokenizer, messages: list[dict], info: TemplateInfo
) -> tuple[str, list[tuple[int, int]], str] | EncodeFailure:
    """``(rendered text, supervised character spans, method)`` for one conversation."""
    try:
        if info.has_generation_tags:
            text, spans = _generation_spans(tokenizer, messages, info)
            return text, spans, "generation"
        text = render(tokenizer, messages)
        spans = _prefix_spans(tokenizer, messages, text)
    except Exception as error:  # noqa: BLE001 - a template may raise anything (raise_exception, TypeError)
        return EncodeFailure("template_error", f"{type(error).__name__}: {error}")
    if spans is not None:
        return text, spans, "prefix"
    found = _search_spans(messages, text, info.end_of_turn)
    if isinstance(found, str):
        return EncodeFailure("template_mismatch", found)
    return text, found, "search"


# ----------------------------------------------------------------------------------------------
# characters -> tokens


def encode_texts(tokenizer, texts: list[str], max_length: int) -> list[tuple[list[int], np.ndarray, bool]]:
    """First ``max_length`` token ids and (start, end) character offsets of each text, + truncated."""
    budget = (max_length + TOKEN_MARGIN) * CHARS_PER_TOKEN
    encode = {"add_special_tokens": False, "return_offsets_mapping": True}
    batch = tokenizer([text[:budget] for text in texts], **encode)
    results = []
    for text, ids, offsets in zip(texts, batch["input_ids"], batch["offset_mapping"]):
        if len(text) > budget and len(ids) < max_length + TOKEN_MARGIN:
            full = tokenizer(text, **encode)  # a cut text must reach past max_length; this one did not
            ids, offsets = full["input_ids"], full["offset_mapping"]
        truncated = len(ids) > max_length
        results.append(
            (
                list(ids[:max_length]),
                np.asarray(offsets[:max_length], dtype=np.int64).reshape(-1, 2),
                truncated,
            )
        )
    return results


def spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Token mask from character spans: 1 iff a token lies wholly inside a span.

    Args:
        offsets: (T, 2) character (start, end) of each token.
    Returns:
        (mask, number of tokens straddling a span edge).
    """
    starts, ends = offsets[:, 0], offsets[:, 1]  # (T,), (T,)
    inside = np.zeros(len(offsets), dtype=bool)
    straddle = np.zeros(len(offsets), dtype=bool)
    for span_start, span_end in spans:
        # start strictly before span_end keeps zero-width tokens at the edge (trimmed whitespace) out
        inside |= (starts >= span_start) & (starts < span_end) & (ends <= span_end)
        straddle |= ((starts < span_start) & (ends > span_start)) | ((starts < span_end) & (ends > span_end))
    return inside.astype(np.int64).tolist(), int((straddle & ~inside).sum())


def encode_conversations(
    tokenizer, conversations: list[list[dict]], max_length: int, info: TemplateInfo | None = None
) -> list[EncodedConversation | EncodeFailure]:
    """Render, tokenise and mask a batch of conversations (lists of ``{"role", "content"}``).

    Args:
        tokenizer: a fast tokenizer with a chat template (offsets are needed for the mask).
        conversations: B conversations.
        max_length: keep the first ``max_length`` tokens of each.
        info: ``probe_template(tokenizer)``, computed here when not given.
    """
    if not tokenizer.is_fast:
        raise TemplateError("assistant masks need a fast tokenizer (character offsets); install `tokenizers`")
    info = info or probe_template(tokenizer)
    rendered = [assistant_spans(tokenizer, messages, info) for messages in conversations]
    texts = [item[0] for item in rendered if not isinstance(item, EncodeFailure)]
    encoded = iter(encode_texts(tokenizer, texts, max_length) if texts else [])
    results: list[EncodedConversation | EncodeFailure] = []
    for item in rendered:
        if isinstance(item, EncodeFailure):
            results.append(item)
            continue
        _, spans, method = item
        ids, offsets, truncated = next(encoded)
        mask, boundary = spans_to_mask(offsets, spans)
        results.append(EncodedConversation(ids, mask, method, truncated, boundary))
    return results


def encode_conversation(tokenizer, messages: list[dict], max_length: int = 1 << 30) -> EncodedConversation:
    """One conversation; raises ``TemplateError`` where the batch API would report a failure."""
    result = encode_conversations(tokenizer, [messages], max_length)[0]
    if isinstance(result, EncodeFailure):
        raise TemplateError(f"{result.reason}: {result.detail}")
    return result
