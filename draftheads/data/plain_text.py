"""Conversations as plain text, for a base model without a chat template (``data.template: plain``).

A pretrained (not instruction-tuned) model such as Gemma 3 270M has no chat template and no
end-of-turn token; it continues text. A conversation is rendered as dialogue it can continue:

    {leading special tokens}{system}\\n\\nUser: {user}\\n\\nAssistant: {answer}\\n\\nUser: ...

each turn a labelled paragraph ("User: ", "Assistant: "; a system turn unlabelled), turns joined by
a blank line, nothing after the last turn. The leading special tokens are those the tokenizer puts
before any text it encodes (Gemma's ``<bos>``, which Gemma models expect), written as text, so the
rendered text tokenises with ``add_special_tokens=False`` as the chat path's does.

Loss mask: an assistant turn's " {answer}" (from the space after "Assistant:", which byte-level
BPE and SentencePiece vocabularies fold into the answer's first token, to its last character);
labels, user and system turns and the blank lines are never supervised. The generation prompt of a
turn is the text up to and including its "Assistant:"; a base model's continuation runs on into the
next turn, so it is cut where "\\n\\nUser:" begins (``answer_text``).
"""

from __future__ import annotations

from draftheads.data.template import EncodedConversation, encode_texts, spans_to_mask

LABELS = {"user": "User:", "assistant": "Assistant:", "system": ""}
TURN_BREAK = "\n\n"
NEXT_TURN = TURN_BREAK + LABELS["user"]  # where a generated answer stops


def leading_text(tokenizer) -> str:
    """The special tokens the tokenizer adds before any text (Gemma: ``<bos>``; "" for none), as text."""
    probe = "a"
    with_special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    without = tokenizer(probe, add_special_tokens=False)["input_ids"]
    count = len(with_special) - len(without)
    if count <= 0 or with_special[count:][: len(without)] != without:
        return ""
    return "".join(tokenizer.convert_ids_to_tokens(with_special[:count]))


def _turn_text(message: dict) -> tuple[str, int]:
    """One turn's text and where its supervised part starts (an assistant turn: the space after
    its label); a system turn is its content alone."""
    label = LABELS[message["role"]]
    if not label:
        return message["content"], 0
    return f"{label} {message['content']}", len(label)


def render_plain(
    messages: list[dict], leading: str = "", add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """``(text, supervised character spans)`` of ``messages`` (``{"role", "content"}``); with
    ``add_generation_prompt``, the text ends with the next assistant turn's label."""
    text, spans = leading, []
    for index, message in enumerate(messages):
        if index:
            text += TURN_BREAK
        turn, supervised_from = _turn_text(message)
        if message["role"] == "assistant":
            spans.append((len(text) + supervised_from, len(text) + len(turn)))
        text += turn
    if add_generation_prompt:
        text += (TURN_BREAK if messages else "") + LABELS["assistant"]
    return text, spans


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The text a base model continues to answer after ``messages``."""
    return render_plain(messages, leading_text(tokenizer), add_generation_prompt=True)[0]


def answer_text(generated: str) -> str:
    """A generated continuation as the answer kept: cut where the next user turn begins, stripped."""
    return generated.split(NEXT_TURN, 1)[0].strip()


def encode_plain(tokenizer, conversations: list[list[dict]], max_length: int) -> list[EncodedConversation]:
    """Render, tokenise and mask a batch of conversations as plain text (method ``plain``).

    Args:
        tokenizer: a fast tokenizer (character offsets map the spans to tokens).
        conversations: B conversations of ``{"role", "content"}`` messages.
        max_length: keep the first ``max_length`` tokens of each.
    """
    leading = leading_text(tokenizer)
    rendered = [render_plain(messages, leading) for messages in conversations]
    encoded = encode_texts(tokenizer, [text for text, _ in rendered], max_length) if rendered else []
    results = []
    for (_, spans), (ids, offsets, truncated) in zip(rendered, encoded):
        mask, boundary = spans_to_mask(offsets, spans)
        results.append(EncodedConversation(ids, mask, "plain", truncated, boundary))
    return results
