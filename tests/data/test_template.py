"""Assistant-only loss masks: tokens under the mask decode to exactly the assistant turns + end-of-turn."""

from __future__ import annotations

import pytest
from data_fixtures import CHATML_TEMPLATE, make_byte_tokenizer

from draftheads.data.sources import read_conversations
from draftheads.data.template import (
    EncodeFailure,
    TemplateError,
    encode_conversation,
    encode_conversations,
    probe_template,
)

CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another, in French?"},
    {"role": "assistant", "content": "Rouge — « red »."},
]


def masked_runs(tokenizer, encoded) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs, current = [], []
    for token, supervised in zip(encoded.input_ids, encoded.loss_mask):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def expected_runs(messages, end_of_turn) -> list[str]:
    # Llama-3's template trims contents; ShareGPT values carry no outer whitespace, so strip is exact.
    return [m["content"].strip() + end_of_turn for m in messages if m["role"] == "assistant"]


def check_masks(tokenizer, conversations) -> set[str]:
    info = probe_template(tokenizer)
    results = encode_conversations(tokenizer, [c.messages for c in conversations], 1 << 20, info)
    for conversation, encoded in zip(conversations, results):
        assert not isinstance(encoded, EncodeFailure), (conversation.id, encoded)
        assert len(encoded.loss_mask) == len(encoded.input_ids) and not encoded.truncated
        assert encoded.boundary_tokens == 0, conversation.id
        assert masked_runs(tokenizer, encoded) == expected_runs(conversation.messages, info.end_of_turn), (
            conversation.id
        )
    return {r.method for r in results}


def test_byte_tokenizer_mask_is_assistant_content_and_im_end(byte_tokenizer):
    encoded = encode_conversation(byte_tokenizer, CONVERSATION)
    assert masked_runs(byte_tokenizer, encoded) == ["Blue.<|im_end|>", "Rouge — « red ».<|im_end|>"]
    assert encoded.method == "prefix"
    # the header <|im_start|>assistant\n right before the answer is not supervised
    text = byte_tokenizer.decode(encoded.input_ids)
    assert text.count("<|im_start|>assistant\n") == 2
    first = encoded.loss_mask.index(1)
    assert byte_tokenizer.decode(encoded.input_ids[first - 11 : first]).endswith("assistant\n")


def test_prefix_breaking_template_falls_back_to_search():
    # An end-of-conversation eos makes render(messages[:i+1]) no prefix of the full render.
    tokenizer = make_byte_tokenizer(
        CHATML_TEMPLATE + "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    info = probe_template(tokenizer)
    encoded = encode_conversation(tokenizer, CONVERSATION)
    assert encoded.method == "search"
    assert masked_runs(tokenizer, encoded) == expected_runs(CONVERSATION, "<|im_end|>")
    assert info.end_of_turn == "<|im_end|>"  # not the end-of-conversation eos after it


def test_generation_tags_agree_with_apply_chat_template_mask():
    tagged = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
        "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    )
    tokenizer = make_byte_tokenizer(tagged)
    encoded = encode_conversation(tokenizer, CONVERSATION)
    assert encoded.method == "generation"
    assert masked_runs(tokenizer, encoded) == ["Blue.<|im_end|>", "Rouge — « red ».<|im_end|>"]
    reference = tokenizer.apply_chat_template(
        CONVERSATION, return_dict=True, return_assistant_tokens_mask=True
    )
    assert reference["input_ids"] == encoded.input_ids
    # transformers masks the content only; ours adds the end-of-turn token right after each span
    ours_without_eot = [
        m and t != tokenizer.eos_token_id for m, t in zip(encoded.loss_mask, encoded.input_ids)
    ]
    assert [bool(m) for m in reference["assistant_masks"]] == ours_without_eot


def test_template_errors_and_missing_template_are_reported():
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    tokenizer = make_byte_tokenizer(CHATML_TEMPLATE)
    tokenizer.chat_template = strict
    failure = encode_conversations(tokenizer, [CONVERSATION, CONVERSATION[1:]], 512)
    assert isinstance(failure[0], EncodeFailure) and failure[0].reason == "template_error"
    assert "no system" in failure[0].detail
    assert not isinstance(failure[1], EncodeFailure)
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        encode_conversation(tokenizer, CONVERSATION)


def test_truncation_keeps_a_prefix_of_the_full_encoding(byte_tokenizer, monkeypatch):
    from draftheads.data import template

    long = CONVERSATION + [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "x" * 3000}]
    full = encode_conversation(byte_tokenizer, long)
    monkeypatch.setattr(template, "CHARS_PER_TOKEN", 1)  # force the cut-text path, then its fallback
    for max_length in (40, 200, 2000):
        cut = encode_conversation(byte_tokenizer, long, max_length=max_length)
        assert cut.truncated and cut.input_ids == full.input_ids[:max_length]
        assert cut.loss_mask == full.loss_mask[:max_length]


@pytest.fixture(scope="module")
def sharegpt_200():
    conversations, _ = read_conversations("sharegpt", limit=200)
    return conversations


@pytest.mark.integration
def test_smollm2_masks_on_200_sharegpt_conversations(smollm2_tokenizer, sharegpt_200):
    assert probe_template(smollm2_tokenizer).end_of_turn == "<|im_end|>"
    assert check_masks(smollm2_tokenizer, sharegpt_200) == {"prefix"}


@pytest.mark.integration
def test_llama3_masks_on_200_sharegpt_conversations(llama3_tokenizer, sharegpt_200):
    assert probe_template(llama3_tokenizer).end_of_turn == "<|eot_id|>"
    assert check_masks(llama3_tokenizer, sharegpt_200) == {"prefix"}
    first = encode_conversation(llama3_tokenizer, sharegpt_200[0].messages)
    assert llama3_tokenizer.convert_ids_to_tokens(first.input_ids[:2]) == [
        "<|begin_of_text|>",
        "<|start_header_id|>",
    ]


@pytest.mark.integration
def test_llama3_generation_tags_give_the_prefix_masks(
    llama3_tokenizer, llama3_generation_tokenizer, sharegpt_200
):
    assert check_masks(llama3_generation_tokenizer, sharegpt_200) == {"generation"}
    messages = [c.messages for c in sharegpt_200[:50]]
    plain = encode_conversations(llama3_tokenizer, messages, 4096)
    tagged = encode_conversations(llama3_generation_tokenizer, messages, 4096)
    assert [(p.input_ids, p.loss_mask) for p in plain] == [(t.input_ids, t.loss_mask) for t in tagged]
