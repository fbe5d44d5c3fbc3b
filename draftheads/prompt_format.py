"""How chat messages become the text a base model continues: its chat template, or plain dialogue.

One rule, chosen by name (``TEMPLATES``), for the training data (``data.template``), distillation
and decoding (``generate``, ``bench``, ``tune-tree``: ``--template``), so a head is evaluated on
prompts rendered as its data was:

    chat   the tokenizer's chat template, its generation prompt added;
    plain  labelled dialogue, for a pretrained base without a template (Gemma 3 270M);
    auto   chat where the tokenizer has a template, plain where it has none.

A pretrained base has no end-of-turn token; it continues text. Plain dialogue renders a
conversation as text it can continue:

    {leading special tokens}{system}\\n\\nUser: {user}\\n\\nAssistant: {answer}\\n\\nUser: ...

each turn a labelled paragraph ("User: ", "Assistant: "; a system turn unlabelled), turns joined by
a blank line, nothing after the last turn. The leading special tokens are those the tokenizer puts
before any text it encodes (Gemma's ``<bos>``, which Gemma models expect), written as text, so the
rendered text tokenises with ``add_special_tokens=False`` as the chat path's does. The prompt of a
turn is the text up to and including its "Assistant:"; the base's continuation runs on into the
next turn, so its answer ends where "\\n\\nUser:" begins: ``answer_text`` cuts the text there, and
decoding stops there (``stop_strings``: the token completing it is the last one kept, as
transformers' ``stop_strings`` keep it, so our decoding and HF ``generate`` stop alike).
"""

from __future__ import annotations

TEMPLATES = ("auto", "chat", "plain")
DEFAULT_TEMPLATE = "auto"
LABELS = {"user": "User:", "assistant": "Assistant:", "system": ""}
TURN_BREAK = "\n\n"
NEXT_TURN = TURN_BREAK + LABELS["user"]  # where a plain answer ends


class TemplateError(ValueError):
    """The tokenizer has no chat template, or its template cannot be used for masking."""


# ---- plain dialogue -----------------------------------------------------------------------------


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
    """The plain text a base model continues to answer after ``messages``."""
    return render_plain(messages, leading_text(tokenizer), add_generation_prompt=True)[0]


def answer_text(generated: str) -> str:
    """A generated continuation as the answer kept: cut where the next user turn begins, stripped."""
    return generated.split(NEXT_TURN, 1)[0].strip()


# ---- the choice -------------------------------------------------------------------------------


def check_template(choice: str, field: str) -> None:
    """Refuse a ``choice`` outside ``TEMPLATES``, naming ``field`` (how it was given)."""
    if choice not in TEMPLATES:
        raise TemplateError(f"{field} must be one of {', '.join(TEMPLATES)}; got '{choice}'")


def choose_template(choice: str, tokenizer, field: str = "data.template") -> str:
    """``chat`` or ``plain``: what ``choice`` (auto | chat | plain) renders messages with for
    ``tokenizer``; ``field`` is how the choice was given, for the refusal of ``chat`` on a
    tokenizer without a chat template."""
    check_template(choice, field)
    has_template = bool(tokenizer.chat_template)
    if choice == "auto":
        return "chat" if has_template else "plain"
    if choice == "chat" and not has_template:
        name = getattr(tokenizer, "name_or_path", "?")
        raise TemplateError(
            f"{field}=chat, but the tokenizer of {name} has no chat template (a pretrained base): set "
            f"{field}=plain to render conversations as 'User: ...' / 'Assistant: ...' text, or add a "
            "template (a chat_template.jinja file in its directory, or 'chat_template' in "
            "tokenizer_config.json)"
        )
    return choice


def prompt_ids(tokenizer, messages: list[dict], template: str) -> list[int]:
    """The token ids a base model continues to answer after ``messages``, rendered by ``template``
    (``chat`` or ``plain``, as ``choose_template`` gives it)."""
    if template == "chat":
        return list(
            tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=False)
        )
    return tokenizer(prompt_text(tokenizer, messages), add_special_tokens=False)["input_ids"]


def stop_strings(template: str) -> tuple[str, ...]:
    """What ends an answer to a ``template`` prompt besides end-of-sequence: a plain answer ends where
    the next user turn begins; a chat template ends its turns with a token (the model's EOS)."""
    return (NEXT_TURN,) if template == "plain" else ()
