"""The continuous batcher writes each conversation's greedy answers exactly as ``model.generate``
does on that conversation alone (no batch, no padding), with slots refilled as answers end."""

from __future__ import annotations

import json

import pytest
import torch
from data_fixtures import load_root_conftest, make_byte_tokenizer

from draftheads.base_model import load_base
from draftheads.config import DistillConfig
from draftheads.data.distill import DistillState, distill
from draftheads.data.distill_hf import ContinuousBatcher
from draftheads.data.sources import Conversation


def conversations() -> list[Conversation]:
    """Prompts of many lengths, one to three turns, so slots finish at different steps."""
    chats = []
    for i in range(7):
        messages = [
            {"role": "user", "content": "q" * (1 + 5 * i) + f" {i}"},
            {"role": "assistant", "content": "x"},
        ]
        for turn in range(i % 3):
            messages += [
                {"role": "user", "content": f"more {turn} " * (i + 1)},
                {"role": "assistant", "content": "y"},
            ]
        chats.append(Conversation(f"c{i}", messages))
    return chats


def greedy_alone(model, tokenizer, conversation: Conversation, max_new_tokens: int) -> dict:
    """The reference: every turn answered by ``model.generate`` on its own prompt."""
    state = DistillState(conversation)
    while (prompt := state.next_prompt()) is not None:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_p=None,
            top_k=None,
        )  # an explicit mask: without one, generate masks every pad token (<|im_end|>) in the prompt
        state.answer(tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return state.finished()


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny(tiny_base_dir):
    """The tiny random Llama with larger weights: at the default init (std 0.02) attention is
    nearly uniform and its answers barely depend on positions or masks, so a wrong one would pass."""
    model, tokenizer = load_base(str(tiny_base_dir))
    generator = torch.Generator().manual_seed(0)
    for parameter in model.parameters():
        if parameter.dim() == 2:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model, tokenizer


@pytest.mark.parametrize("slots", [1, 3, 16])
def test_answers_equal_greedy_generate_per_conversation(tiny, tmp_path, slots):
    model, tokenizer = tiny
    chats = conversations()
    # A token some first answers produce and others do not, as end of sequence, so answers end at
    # different steps (the random model rarely emits its real EOS).
    first_answers = []
    for chat in chats:
        text = tokenizer.apply_chat_template(chat.messages[:1], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        output = model.generate(
            ids, max_new_tokens=12, do_sample=False, top_p=None, top_k=None
        )  # eos = pad here
        first_answers.append(set(output[0, ids.shape[1] :].tolist()))
    shared = [t for t in set().union(*first_answers) if sum(t in a for a in first_answers) < len(chats)]
    original_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = max(shared, key=lambda t: sum(t in a for a in first_answers))
    try:
        expected = {c.id: greedy_alone(model, tokenizer, c, max_new_tokens=12) for c in chats}
        out = tmp_path / "out.jsonl"
        config = DistillConfig(max_new_tokens=12, batch_size=slots)
        counts = distill(model, tokenizer, chats, out, config, progress=False)
    finally:
        model.generation_config.eos_token_id = original_eos
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert written == expected
    assert counts.written == 7 and counts.answers == sum(
        m["role"] == "assistant" for c in chats for m in c.messages
    )
    lengths = {len(t["value"]) for r in expected.values() for t in r["conversations"] if t["from"] == "gpt"}
    assert len(lengths) > 1  # some answers ended early, others ran to max_new_tokens
    assert 0 < counts.new_tokens <= 12 * counts.answers and counts.tokens_per_second > 0


def test_sampling_is_seeded(tiny, tmp_path):
    model, tokenizer = tiny
    config = DistillConfig(temperature=1.0, max_new_tokens=8, batch_size=4)
    texts = []
    for name in ("a", "b"):
        torch.manual_seed(123)  # the batcher's own generator decides, not the global one
        out = tmp_path / f"{name}.jsonl"
        distill(model, tokenizer, conversations(), out, config, progress=False)
        texts.append(sorted(out.read_text().splitlines()))
    assert texts[0] == texts[1]


def padded_cost(groups: list[list[int]], lengths: list[int], forward_tokens: int) -> int:
    return sum(forward_tokens + len(group) * max(lengths[i] for i in group) for group in groups)


def partitions(items: list[int]):
    """Every way to split ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for split in partitions(rest):
        yield [[first], *split]
        for k in range(len(split)):
            yield split[:k] + [[first, *split[k]]] + split[k + 1 :]


@pytest.mark.parametrize("seed", range(6))
def test_prefill_groups_cover_every_prompt_at_the_least_cost(seed):
    from draftheads.data.distill_hf import prefill_groups

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (6,), generator=generator).tolist()
    groups = prefill_groups(lengths, forward_tokens=12)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    best = min(padded_cost(p, lengths, 12) for p in partitions(list(range(len(lengths)))))
    assert padded_cost(groups, lengths, 12) == best


def test_prefill_groups_split_far_apart_lengths_and_keep_equal_ones_together():
    from draftheads.data.distill_hf import prefill_groups

    assert prefill_groups([300, 20, 22, 310]) == [[1, 2], [0, 3]]
    assert prefill_groups([50] * 5) == [[0, 1, 2, 3, 4]]
    assert prefill_groups([40, 400], forward_tokens=10_000) == [[0, 1]]  # a forward dearer than padding


def test_greedy_distill_on_a_sliding_window_base_equals_generate(tmp_path):
    """Gemma 3's sliding layers (window 8) see only the last 8 positions; the prompts here are
    longer, so a batcher that gave them the full prefix would answer otherwise than generate."""
    tokenizer = make_byte_tokenizer()
    # untied, larger weights: a tied random Gemma repeats one token whatever it attends to
    model = load_root_conftest().make_tiny_gemma3(vocab_size=len(tokenizer), tie_word_embeddings=False)
    generator = torch.Generator().manual_seed(0)
    for parameter in model.parameters():
        if parameter.dim() == 2:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    chats = [
        Conversation(f"c{i}", [{"role": "user", "content": text}, {"role": "assistant", "content": ""}])
        for i, text in enumerate(["hi", "hello there, how are you", "tell me about sliding windows"])
    ]
    config = DistillConfig(max_new_tokens=10, batch_size=2)
    expected = {chat.id: greedy_alone(model, tokenizer, chat, max_new_tokens=10) for chat in chats}
    out = tmp_path / "out.jsonl"
    engine = ContinuousBatcher(model, tokenizer, config)
    distill(model, tokenizer, chats, out, config, progress=False, engine=engine.run)
    written = {record["id"]: record for record in map(json.loads, out.read_text().splitlines())}
    assert written == expected
    assert all(len(record["conversations"][1]["value"]) > 3 for record in written.values())
