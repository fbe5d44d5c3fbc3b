"""Plain-text rendering (``data.template: plain``) for a base without a chat template: the rendered
text, a loss mask on the answers alone, the choice between renderings, the pipeline and distill."""

from __future__ import annotations

import json

import pytest
from data_fixtures import make_byte_tokenizer, sharegpt_record, write_jsonl
from transformers import AutoConfig

from draftheads.config import DataConfig, DistillConfig
from draftheads.data.distill import TurnQueue, distill
from draftheads.data.pipeline import build_datasets
from draftheads.data.plain_text import encode_plain
from draftheads.data.rendering import RENDERINGS, resolve_rendering
from draftheads.data.sources import Conversation
from draftheads.prompt_format import TemplateError, answer_text, leading_text, prompt_text, render_plain
from draftheads.settings import ConfigError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6, of course."},
]
RENDERED = (
    "Be brief.\n\nUser: What is 2+2?\n\nAssistant: It is 4.\n\nUser: And 3+3?\n\nAssistant: 6, of course."
)


@pytest.fixture(scope="module")
def plain_tokenizer():
    """The byte tokenizer without a chat template (a pretrained base's)."""
    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def test_a_conversation_renders_as_labelled_turns_and_only_answers_are_supervised(plain_tokenizer):
    text, spans = render_plain(CONVERSATION)
    assert text == RENDERED
    assert [text[start:end] for start, end in spans] == [" It is 4.", " 6, of course."]
    encoded = encode_plain(plain_tokenizer, [CONVERSATION], max_length=1000)[0]
    assert plain_tokenizer.decode(encoded.input_ids) == RENDERED and encoded.method == "plain"
    supervised = [token for token, kept in zip(encoded.input_ids, encoded.loss_mask) if kept]
    assert plain_tokenizer.decode(supervised) == " It is 4. 6, of course."
    assert encoded.boundary_tokens == 0 and not encoded.truncated
    short = encode_plain(plain_tokenizer, [CONVERSATION], max_length=10)[0]
    assert short.truncated and short.input_ids == encoded.input_ids[:10] and sum(short.loss_mask) == 0


def test_the_prompt_ends_at_the_answer_label_and_answers_stop_at_the_next_turn(plain_tokenizer):
    assert prompt_text(plain_tokenizer, CONVERSATION[:2]) == "Be brief.\n\nUser: What is 2+2?\n\nAssistant:"
    assert answer_text(" It is 4.\n\nUser: and now?\n\nAssistant: no") == "It is 4."
    assert answer_text(" four\n\nmore text") == "four\n\nmore text"  # only a user label ends it
    # rendering the kept answer gives back the prompt followed by the tokens the base wrote
    answered = render_plain([*CONVERSATION[:2], {"role": "assistant", "content": "It is 4."}])[0]
    assert answered == prompt_text(plain_tokenizer, CONVERSATION[:2]) + " It is 4."


def test_gemma3_text_starts_with_bos_and_masks_whole_tokens(gemma3_tokenizer):
    assert gemma3_tokenizer.chat_template is None and leading_text(gemma3_tokenizer) == "<bos>"
    encoded = encode_plain(gemma3_tokenizer, [CONVERSATION], max_length=1000)[0]
    assert encoded.input_ids[0] == gemma3_tokenizer.bos_token_id and encoded.boundary_tokens == 0
    supervised = [token for token, kept in zip(encoded.input_ids, encoded.loss_mask) if kept]
    assert gemma3_tokenizer.decode(supervised) == " It is 4. 6, of course."
    # the encoding is what the tokenizer gives the text with its own special tokens
    assert encoded.input_ids == gemma3_tokenizer(RENDERED)["input_ids"]


def test_auto_follows_the_tokenizer_and_chat_without_a_template_is_one_line(plain_tokenizer):
    chat_tokenizer = make_byte_tokenizer()
    assert resolve_rendering("auto", chat_tokenizer) is RENDERINGS["chat"]
    assert resolve_rendering("auto", plain_tokenizer) is RENDERINGS["plain"]
    assert resolve_rendering("plain", chat_tokenizer) is RENDERINGS["plain"]
    with pytest.raises(TemplateError, match=r"^data\.template=chat, but .* has no chat template") as error:
        resolve_rendering("chat", plain_tokenizer)
    assert "\n" not in str(error.value) and "data.template=plain" in str(error.value)
    with pytest.raises(ConfigError, match="data.template must be one of"):
        DataConfig(template="jinja").validate()


def test_the_pipeline_builds_plain_examples_and_keys_the_cache_by_rendering(tmp_path, plain_tokenizer):
    records = [sharegpt_record(f"c{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(6)]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    data = DataConfig(source=str(source), validation_size=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TemplateError, match="data.template=chat"):
        build_datasets(DataConfig(**{**data.__dict__, "template": "chat"}), plain_tokenizer, "tiny")
    train, validation, report = build_datasets(data, plain_tokenizer, "tiny")  # auto: plain
    assert report.template == "plain" and report.mask_methods == {"plain": 6}
    assert len(train) == 5 and len(validation) == 1
    row = train[0]
    supervised = [token for token, kept in zip(row["input_ids"], row["loss_mask"]) if kept]
    assert plain_tokenizer.decode(supervised) == f" answer {row['id'][1:]}"
    # the same source rendered by a chat template is another cache entry
    chat_data = DataConfig(**{**data.__dict__, "template": "chat"})
    _, _, chat_report = build_datasets(chat_data, make_byte_tokenizer(), "tiny")
    assert chat_report.template == "chat" and chat_report.cache_path != report.cache_path


def test_distill_answers_plain_prompts_and_cuts_at_the_next_turn(tmp_path, plain_tokenizer):
    """A stub engine that writes an answer and runs on into a made-up next turn, as a base does."""
    prompts = []

    def engine(queue: TurnQueue) -> None:
        while (turn := queue.take()) is not None:
            prompts.append(plain_tokenizer.decode(turn.prompt_ids))
            answer = f" answer {len(prompts)}\n\nUser: something else\n\nAssistant: more"
            queue.give(turn.key, plain_tokenizer(answer, add_special_tokens=False)["input_ids"])

    chats = [Conversation("a", CONVERSATION[1:])]
    out = tmp_path / "out.jsonl"
    config = DistillConfig(max_new_tokens=8)
    context = AutoConfig.for_model("llama", max_position_embeddings=4096)
    rendering = resolve_rendering("auto", plain_tokenizer)
    distill(
        None,
        plain_tokenizer,
        chats,
        out,
        config,
        progress=False,
        engine=engine,
        model_config=context,
        rendering=rendering,
    )
    record = json.loads(out.read_text())
    answers = [turn["value"] for turn in record["conversations"]]
    assert answers == ["What is 2+2?", "answer 1", "And 3+3?", "answer 2"]
    assert prompts == [
        "User: What is 2+2?\n\nAssistant:",
        "User: What is 2+2?\n\nAssistant: answer 1\n\nUser: And 3+3?\n\nAssistant:",
    ]
