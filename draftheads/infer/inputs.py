"""Checking the prompts ``SpeculativeGenerator.generate`` is given, before the tokenizer sees them:
a careless one is refused as one line naming the prompt, the message and the field, where the chat
template would fail deep in jinja (``'dict object' has no attribute 'content'``). Chat messages
become ids by the template chosen (``draftheads.prompt_format``: the chat template or plain
dialogue)."""

from __future__ import annotations

from collections.abc import Sequence

from draftheads.prompt_format import LABELS, prompt_ids

MESSAGE_FIELDS = ("role", "content")  # what every chat template reads from a message


class PromptError(ValueError):
    """A prompt ``generate`` cannot read; the message starts with which prompt (``prompt 2: ...``)."""


def check_messages(messages: Sequence, where: str) -> None:
    """Raise PromptError naming ``where``, the message and the field unless every message is a dict
    with a string ``role`` and a ``content`` (a string, or a list of parts for multimodal templates)."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"{where}: message {index} must be a dict, got {type(message).__name__}")
        for name in MESSAGE_FIELDS:
            if name not in message or message[name] is None:
                raise PromptError(f"{where}: message {index} {str(message)[:60]} has no '{name}'")
        if not isinstance(message["role"], str):
            raise PromptError(
                f"{where}: message {index}: 'role' must be a string, got {message['role']!r:.40}"
            )
        if not isinstance(message["content"], (str, list)):
            kind = type(message["content"]).__name__
            raise PromptError(f"{where}: message {index}: 'content' must be a string, got {kind}")


def check_plain_messages(messages: Sequence, where: str) -> None:
    """Raise PromptError naming ``where`` and the message unless plain dialogue can render every
    message: a role it labels (``prompt_format.LABELS``) and text content."""
    for index, message in enumerate(messages):
        if message["role"] not in LABELS:
            roles = ", ".join(LABELS)
            raise PromptError(
                f"{where}: message {index}: plain text renders the roles {roles}; got {message['role']!r:.40}"
            )
        if not isinstance(message["content"], str):
            raise PromptError(f"{where}: message {index}: plain text renders string contents, got a list")


def messages_prompt_ids(tokenizer, messages: Sequence, where: str, template: str) -> list[int]:
    """The token ids of ``messages`` rendered by ``template`` (chat | plain,
    ``prompt_format.choose_template``), generation prompt added; careless messages and the chat
    template's own refusals raise PromptError naming ``where``."""
    import jinja2  # a transformers dependency, needed only here

    check_messages(messages, where)
    if template == "plain":
        check_plain_messages(messages, where)
    try:
        return prompt_ids(tokenizer, list(messages), template)
    except jinja2.TemplateError as err:  # an undefined field, or the template's raise_exception
        raise PromptError(f"{where}: the chat template refuses these messages: {err}") from None
