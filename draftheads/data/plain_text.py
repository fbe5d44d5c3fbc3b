"""Conversations as plain text, for a base model without a chat template (``data.template: plain``).

The text is plain dialogue (``draftheads.prompt_format``, the rendering decoding shares):

    {leading special tokens}{system}\\n\\nUser: {user}\\n\\nAssistant: {answer}\\n\\nUser: ...

Loss mask: an assistant turn's " {answer}" (from the space after "Assistant:", which byte-level
BPE and SentencePiece vocabularies fold into the answer's first token, to its last character);
labels, user and system turns and the blank lines are never supervised.
"""

from __future__ import annotations

from draftheads.data.template import EncodedConversation, encode_texts, spans_to_mask
from draftheads.prompt_format import leading_text, render_plain


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
