"""``draftheads synth-prompts`` (prompts sampled from the base's own chat template) and
``draftheads distill --prompts`` (answering them): the pre-query template, what is kept and dropped,
a resumed run that continues the seed sequence, and the CLI end to end on the tiny random base."""

from __future__ import annotations

import json

import pytest
from data_fixtures import make_byte_tokenizer, write_jsonl

from draftheads.cli import main
from draftheads.data.distill import conversations_from_prompts
from draftheads.data.prompts import Prompt, load_prompts
from draftheads.data.self_prompts import SynthSettings, fold, pre_query_ids, synthesize
from draftheads.data.sources import DataError


@pytest.fixture
def tokenizer():
    return make_byte_tokenizer()


def test_pre_query_template_is_the_text_before_a_users_words(tokenizer):
    ids = pre_query_ids(tokenizer)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n"
    )
    with_system = tokenizer.decode(pre_query_ids(tokenizer, system="Be brief."))
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_a_template_that_alters_the_users_text_is_refused():
    tokenizer = make_byte_tokenizer("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(DataError, match="chat template"):
        pre_query_ids(tokenizer)


class ScriptedSampler:
    """Answers each call with the next scripted batch of texts (None: a row cut before its end), and
    records the seeds it was called with."""

    def __init__(self, tokenizer, batches: list[list[str | None]]):
        self.tokenizer, self.batches, self.seeds, self.prefixes = tokenizer, list(batches), [], []

    def __call__(self, prefix, rows, seed):
        self.seeds.append(seed)
        self.prefixes.append(prefix)
        texts = self.batches.pop(0)
        assert len(texts) == rows
        end = self.tokenizer.eos_token_id
        encode = self.tokenizer.encode
        return [encode("open ended") if t is None else encode(t) + [end, end] for t in texts]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_synthesize_keeps_finished_new_prompts_and_resumes_the_seed_sequence(tmp_path, tokenizer):
    out = tmp_path / "prompts.jsonl"
    settings = SynthSettings(count=3, batch_size=3, seed=7)
    sampler = ScriptedSampler(
        tokenizer, [["Plan a trip.", None, "  "], ["plan  a TRIP.", "Name a river.", "Why?"]]
    )
    counts = synthesize(sampler, tokenizer, out, settings)
    assert sampler.seeds == [7, 8]
    assert sampler.prefixes[0] == pre_query_ids(tokenizer)
    assert [r["turns"] for r in records(out)] == [["Plan a trip."], ["Name a river."], ["Why?"]]
    assert [r["id"] for r in records(out)] == ["self-7-0-0", "self-7-1-1", "self-7-1-2"]
    assert counts.kept == 3 and counts.sampled == 6
    assert counts.dropped == {"unfinished": 1, "empty": 1, "duplicate": 1}
    # asked for more, a second run continues with the next batch's seed and skips known prompts
    more = ScriptedSampler(tokenizer, [["why?", "A new one.", "Another."]])
    counts = synthesize(more, tokenizer, out, SynthSettings(count=5, batch_size=3, seed=7))
    assert more.seeds == [9]
    assert counts.existing == 3 and counts.kept == 2 and counts.dropped == {"duplicate": 1}
    assert [r["turns"][0] for r in records(out)][3:] == ["A new one.", "Another."]
    assert load_prompts(str(out))[3] == Prompt("self-7-2-1", "self", ["A new one."])
    # a file that holds enough already costs no sampling
    none = ScriptedSampler(tokenizer, [])
    assert synthesize(none, tokenizer, out, SynthSettings(count=5, batch_size=3, seed=7)).kept == 0
    assert none.seeds == []


def test_an_interrupted_last_line_is_cut_and_a_foreign_file_refused(tmp_path, tokenizer, capsys):
    out = tmp_path / "prompts.jsonl"
    out.write_text('{"id": "self-0-0-0", "turns": ["Hi there."], "category": "self"}\n{"id": "self-0-1')
    sampler = ScriptedSampler(tokenizer, [["Hi there!", "Next."]])
    synthesize(sampler, tokenizer, out, SynthSettings(count=3, batch_size=2))
    assert "dropping an incomplete last line (16 bytes)" in capsys.readouterr().out
    assert sampler.seeds == [1]
    assert [r["turns"][0] for r in records(out)] == ["Hi there.", "Hi there!", "Next."]
    foreign = write_jsonl(tmp_path / "chats.jsonl", [{"id": "a", "conversations": []}])
    with pytest.raises(DataError, match="chats.jsonl line 1"):
        synthesize(ScriptedSampler(tokenizer, []), tokenizer, foreign, SynthSettings(count=3))
    assert foreign.read_text().count("\n") == 1


OWN_RECORD = b'{"id": "self-0-0-0", "turns": ["Hi there."], "category": "self"}\n'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"keep me 1\nkeep me 2", "line 1: not JSON"),
        (b'{"id": "a", "turns": []}\n', "line 1: 'turns' must be a non-empty list"),
        (b'{"id": "a", "prompt": "hi"}\n', "line 1: no 'turns'"),
        (b"[1, 2]\n", "line 1: not a JSON object but list"),
        (OWN_RECORD + b"keep me", "line 2 \\(no newline at its end\\): not the start of a record"),
        (b'{"id": "a", "conversations": []}', "line 1 \\(no newline at its end\\): no 'turns'"),
    ],
)
def test_a_file_that_is_not_a_prompts_file_is_refused_unchanged(tmp_path, tokenizer, content, message):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    with pytest.raises(DataError, match=f"notes.txt {message}.*give another --out"):
        synthesize(ScriptedSampler(tokenizer, []), tokenizer, notes, SynthSettings(count=3))
    assert notes.read_bytes() == content


def test_the_command_refuses_a_foreign_out_before_loading_the_base(tmp_path, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the base was loaded")

    monkeypatch.setattr("draftheads.base_model.load_base", no_loading)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"keep me 1\nkeep me 2")
    assert main(["synth-prompts", "--out", str(notes), "--base", str(tmp_path / "no-base")]) == 3
    error = capsys.readouterr().err
    assert error.startswith(f"draftheads synth-prompts: {notes} line 1: not JSON") and error.count("\n") == 1
    assert notes.read_bytes() == b"keep me 1\nkeep me 2"


def test_a_command_error_carries_one_prefix(tmp_path, capsys):
    arguments = ["synth-prompts", "--out", str(tmp_path / "p.jsonl"), "--temperature", "0"]
    assert main(arguments) == 3
    assert capsys.readouterr().err == (
        "draftheads synth-prompts: temperature must be > 0 (greedy sampling writes one prompt), got 0.0\n"
    )


@pytest.mark.parametrize(
    ("field", "value"), [("count", 0), ("batch_size", 0), ("max_new_tokens", 0), ("temperature", 0.0)]
)
def test_settings_that_cannot_work_are_refused(field, value):
    with pytest.raises(DataError, match=field):
        SynthSettings(**{field: value}).validate()


def test_a_model_that_never_ends_its_turn_stops_the_run(tmp_path, tokenizer):
    out = tmp_path / "prompts.jsonl"
    never = ScriptedSampler(tokenizer, [[None, None]] * 20)
    with pytest.raises(DataError, match="last 20 batches of 2 kept no prompt.*unfinished"):
        synthesize(never, tokenizer, out, SynthSettings(count=1, batch_size=2))
    assert len(never.seeds) == 20 and out.read_text() == ""


def test_fold_ignores_case_and_spacing():
    assert fold("  Plan\n a   TRIP ") == fold("plan a trip") != fold("plan a trip!")


def test_prompts_become_conversations_answered_turn_by_turn():
    conversations = conversations_from_prompts([Prompt("p", "self", ["one", "two"])])
    assert conversations[0].id == "p"
    roles = [(m["role"], m["content"]) for m in conversations[0].messages]
    assert roles == [("user", "one"), ("assistant", ""), ("user", "two"), ("assistant", "")]


def test_synth_then_distill_on_the_tiny_base(tmp_path, tiny_base_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    arguments = ["--base", str(tiny_base_dir), "--no-pack"]
    synth = [
        "synth-prompts",
        "--out",
        str(prompts),
        "--count",
        "3",
        "--batch-size",
        "4",
        "--max-new-tokens",
        "64",
    ]
    # the tiny random model ends a turn within 64 tokens about one time in five: the run samples
    # until 3 finished, distinct, non-empty prompts are kept
    assert main([*synth, *arguments]) == 0
    written = records(prompts)
    assert len(written) == 3
    assert len({fold(r["turns"][0]) for r in written}) == 3
    assert "[synth-prompts]" in capsys.readouterr().out
    out = tmp_path / "answers.jsonl"
    distill = [
        "distill",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--max-new-tokens",
        "8",
    ]
    assert main([*distill, *arguments]) == 0
    answered = records(out)
    assert sorted(r["id"] for r in answered) == sorted(r["id"] for r in written)
    for record in answered:
        source = next(r for r in written if r["id"] == record["id"])
        assert [t["from"] for t in record["conversations"]] == ["human", "gpt"]
        assert record["conversations"][0]["value"] == source["turns"][0]
