"""Chat messages for a base without a chat template (a pretrained base: the tiny random Gemma 3 over
a byte tokenizer that, as Gemma's, puts a bos before any text): rendered as plain dialogue, as its
training data is (``draftheads.prompt_format``), through the API, bench and tune-tree's prompts;
a plain answer stops where the base begins the next "User:" turn, at the same token in our decoding
and in HF ``generate``; ``chat`` without a template is refused in one line; and a tokenizer with a
chat template renders exactly what ``apply_chat_template`` gives."""

from __future__ import annotations

import itertools

import pytest
import torch

from draftheads.bench import BenchPrompt, HFMethod, SpeculativeMethod, build_prompts, run_bench
from draftheads.heads import Eagle3Config, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.inputs import PromptError
from draftheads.tuning.held_out import greedy_continuations, held_out_prompts
from tests.conftest import make_tiny_llama
from tests.data.data_fixtures import (
    make_byte_tokenizer,
    make_pretrained_byte_tokenizer,
    make_tiny_gemma3_for,
    save_tiny_gemma3_base,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("single_thread")

NEXT_TURN = "\n\nUser:"  # where a plain answer ends
QUESTIONS = ["Say 0 twice, then count from one to five.", "Name three colours of the rainbow."]
MESSAGES = [[{"role": "user", "content": question}] for question in QUESTIONS]


def plain_ids(tokenizer, question: str) -> list[int]:
    """The plain dialogue prompt of one user turn, written out: the bos, the turn, the answer label."""
    return tokenizer(f"<|im_start|>User: {question}\n\nAssistant:", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def plain_gemma():
    tokenizer = make_pretrained_byte_tokenizer()
    return tokenizer, make_tiny_gemma3_for(tokenizer)


@pytest.fixture(scope="module")
def answering_gemma():
    """A tiny Gemma 3 that answers "42" and begins the next turn: attention and MLPs write nothing,
    so each next token follows from the last one alone (lm_head rows are the normed embeddings of
    the tokens they follow): ':' -> '4' -> '2' -> '\\n\\n' -> 'User' -> ':'. Its tokenizer has
    Gemma's one token for a blank line, so the stop string spans three tokens."""
    tokenizer = make_pretrained_byte_tokenizer()
    tokenizer.add_tokens(["\n\n", "User"])
    model = make_tiny_gemma3_for(tokenizer, tie_word_embeddings=False)
    chain = [tokenizer.convert_tokens_to_ids(token) for token in (":", "4", "2", "\n\n", "User", ":")]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight  # (V, h)
        normed = embeddings / embeddings.pow(2).mean(-1, keepdim=True).sqrt()
        model.lm_head.weight.zero_()
        for token, following in itertools.pairwise(chain):
            model.lm_head.weight[following] += 10 * normed[token]
    return tokenizer, model


def generate_reference(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy ``generate`` stopping at the next turn (the token completing it kept)."""
    output = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        stop_strings=[NEXT_TURN],
        tokenizer=tokenizer,
    )
    return output[0].tolist()


def test_messages_render_as_plain_dialogue_and_decode_as_generate_does(plain_gemma):
    tokenizer, model = plain_gemma
    torch.manual_seed(0)  # the untrained head is random: fix it
    head = build_head(model, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64))
    generator = SpeculativeGenerator(model, head, tokenizer, tree="dynamic-cpu")
    result = generator.generate(MESSAGES, max_new_tokens=16)
    for question, row in zip(QUESTIONS, result.results):
        prompt = plain_ids(tokenizer, question)
        assert len(prompt) > model.config.sliding_window
        assert row.sequences[0, : row.prompt_length].tolist() == prompt
        assert row.sequences[0].tolist() == generate_reference(model, tokenizer, prompt, 16)
    alone = generator.generate(MESSAGES[0], max_new_tokens=16, template="plain")
    assert alone.sequences.tolist() == result.results[0].sequences.tolist()


def test_chat_without_a_template_is_refused_in_one_line(plain_gemma):
    from draftheads.prompt_format import TemplateError

    tokenizer, model = plain_gemma
    generator = SpeculativeGenerator(model, None, tokenizer)
    with pytest.raises(
        TemplateError, match=r"^template=chat, but the tokenizer .* has no chat template"
    ) as err:
        generator.generate(MESSAGES[0], max_new_tokens=2, template="chat")
    assert "\n" not in str(err.value) and "template=plain" in str(err.value)
    with pytest.raises(TemplateError, match="^template must be one of auto, chat, plain; got 'jinja'$"):
        generator.generate([5, 6, 7], max_new_tokens=2, template="jinja")
    with pytest.raises(PromptError, match="^prompt: message 0: plain text renders the roles user, .*'tool'"):
        generator.generate([{"role": "tool", "content": "42"}], max_new_tokens=2)


def test_a_plain_answer_stops_at_the_next_turn_in_our_decoding_and_in_generate(answering_gemma):
    tokenizer, model = answering_gemma
    generator = SpeculativeGenerator(model, None, tokenizer)  # context drafts
    prompt = plain_ids(tokenizer, QUESTIONS[0])
    result = generator.generate(MESSAGES[0], max_new_tokens=12)
    assert tokenizer.decode(result.new_tokens) == "42" + NEXT_TURN  # the completing token is kept
    assert result.text == "42" and result.finish_reason == "stop"
    assert result.sequences[0].tolist() == generate_reference(model, tokenizer, prompt, 12)
    assert len(generator.generate(prompt, max_new_tokens=12).new_tokens) == 12  # ids: no rendering, no stop
    # tune-tree's continuations stop there too
    (sequence, length), *_ = greedy_continuations(
        generator, [torch.tensor(prompt)], 12, progress=False, stop=(NEXT_TURN,)
    )
    assert sequence.tolist() == result.sequences[0].tolist() and length == len(prompt)


def test_bench_methods_stop_alike_on_plain_prompts_alone_and_in_a_batch(answering_gemma, tmp_path):
    """Rows that stop at different steps: HF pads the first one finished after its stop, and every
    method's tokens end at the same stop token."""
    tokenizer, model = answering_gemma
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"id": "a", "prompt": QUESTIONS[0]}])
    (asked,) = build_prompts(str(path), tokenizer, None)
    assert asked.input_ids[0].tolist() == plain_ids(tokenizer, QUESTIONS[0]) and asked.stop == (NEXT_TURN,)
    four = tokenizer.convert_tokens_to_ids("4")
    later = BenchPrompt(
        "b", asked.category, torch.cat([asked.input_ids, torch.tensor([[four]])], 1), asked.stop
    )
    context = SpeculativeMethod("context", SpeculativeGenerator(model, None, tokenizer))
    methods = [HFMethod("generate", model, tokenizer), context]
    for batch_size in (1, 2):
        samples = run_bench(
            methods, [asked, later], 12, 0.0, warmup_tokens=2, progress=False, batch_size=batch_size
        )
        texts = {(s.method, s.prompt_id): tokenizer.decode(s.tokens) for s in samples}
        assert texts == {
            (method, prompt): answer + NEXT_TURN
            for method in ("generate", "context")
            for prompt, answer in (("a", "42"), ("b", "2"))
        }, f"batch size {batch_size}"
        assert all(s.agrees for s in samples)


def test_the_commands_render_plain_prompts_and_refuse_chat_naming_the_flag(tmp_path, capsys):
    from draftheads.cli import main

    base = str(save_tiny_gemma3_base(tmp_path / "base"))
    generate = ["generate", "--base", base, "--prompt", QUESTIONS[0], "--max-new-tokens", "4"]
    generate += ["--pack", "off", "--no-adaptive"]
    assert main(generate) == 0
    assert main([*generate, "--template", "chat"]) == 3
    assert "--template=chat, but the tokenizer of" in capsys.readouterr().err
    head_dir = tmp_path / "head"
    model = make_tiny_gemma3_for(make_pretrained_byte_tokenizer())
    build_head(model, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), base).save_pretrained(
        head_dir
    )
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": 0, "turns": [QUESTIONS[0]]}])
    tune = ["tune-tree", "--heads", str(head_dir), "--data", str(prompts), "--skip", "0", "--pack", "off"]
    assert main([*tune, "--template", "chat"]) == 3
    assert "--template=chat, but the tokenizer of" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["smollm2", "chatml-bytes"])
def test_a_tokenizer_with_a_chat_template_renders_as_apply_chat_template(which, request, tmp_path):
    tokenizer = request.getfixturevalue("smollm2_tokenizer") if which == "smollm2" else make_byte_tokenizer()
    expected = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        for messages in MESSAGES
    ]
    model = make_tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    result = SpeculativeGenerator(model, None, tokenizer).generate(MESSAGES, max_new_tokens=1)
    assert [row.sequences[0, : row.prompt_length].tolist() for row in result.results] == expected
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"id": i, "turns": [q]} for i, q in enumerate(QUESTIONS)])
    built = build_prompts(str(path), tokenizer, None)
    assert [p.input_ids[0].tolist() for p in built] == expected and all(p.stop == () for p in built)
    assert [p.tolist() for p in held_out_prompts(str(path), 0, 2, tokenizer, 256)] == expected
