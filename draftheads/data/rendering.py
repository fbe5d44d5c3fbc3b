"""How conversations become training text, chosen once by ``data.template`` (``config.DATA_TEMPLATES``).

Two renderings, registered by name: ``chat``, the tokenizer's own chat template with an
assistant-only loss mask (``draftheads.data.template``); ``plain``, labelled dialogue text for a
pretrained base without a template, its answers masked (``draftheads.data.plain_text``). Both give
the training pipeline its examples and ``distill`` the text a turn is answered from, so the data a
head trains on and the answers a base writes for it are rendered alike. Which one a choice names
(``auto``: ``chat`` where the tokenizer has a chat template, ``plain`` where it has none; ``chat``
without a template refused) is ``draftheads.prompt_format.choose_template``'s rule, the one
decoding follows too.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftheads import prompt_format
from draftheads.data import plain_text, template
from draftheads.data.template import TemplateInfo


@dataclass(frozen=True)
class ChatRendering:
    """The tokenizer's chat template (``draftheads.data.template``)."""

    name: str = "chat"

    def probe(self, tokenizer) -> TemplateInfo | None:
        return template.probe_template(tokenizer)

    def encode(self, tokenizer, conversations, max_length: int, info: TemplateInfo | None):
        return template.encode_conversations(tokenizer, conversations, max_length, info)

    def prompt_text(self, tokenizer, messages: list[dict]) -> str:
        return template.render(tokenizer, messages, add_generation_prompt=True)

    def answer_text(self, generated: str) -> str:
        return generated.strip()


@dataclass(frozen=True)
class PlainRendering:
    """Labelled dialogue text (``draftheads.data.plain_text``)."""

    name: str = "plain"

    def probe(self, tokenizer) -> TemplateInfo | None:
        return None  # nothing to probe: the rendering is fixed

    def encode(self, tokenizer, conversations, max_length: int, info: TemplateInfo | None):
        return plain_text.encode_plain(tokenizer, conversations, max_length)

    def prompt_text(self, tokenizer, messages: list[dict]) -> str:
        return prompt_format.prompt_text(tokenizer, messages)

    def answer_text(self, generated: str) -> str:
        return prompt_format.answer_text(generated)


Rendering = ChatRendering | PlainRendering
RENDERINGS: dict[str, Rendering] = {"chat": ChatRendering(), "plain": PlainRendering()}


def resolve_rendering(choice: str, tokenizer, field: str = "data.template") -> Rendering:
    """The rendering ``choice`` (auto | chat | plain) names for ``tokenizer``; ``field`` is how the
    choice was given, for the refusals (``prompt_format.choose_template``)."""
    return RENDERINGS[prompt_format.choose_template(choice, tokenizer, field)]
