"""A distilled corpus grows one chunk per ``draftheads distill --corpus`` run, resumes an interrupted
chunk, refuses a run with other settings, and reads back through the pipeline as a local source."""

from __future__ import annotations

import gzip
import json

import pytest
from data_fixtures import sharegpt_record, write_jsonl

from draftheads.cli import main
from draftheads.data.corpus import MANIFEST, Corpus, CorpusError
from draftheads.data.pipeline import source_identity
from draftheads.data.sources import read_conversations


@pytest.fixture
def source(tmp_path):
    # a raw U+2028 (JSON Lines written with ensure_ascii=False keep it) is not a line break
    records = [
        sharegpt_record(f"c{i}", ("human", f"question {i}\u2028and"), ("gpt", "old")) for i in range(5)
    ]
    return write_jsonl(tmp_path / "chats.jsonl", records)


def _distill(tiny_base_dir, source, corpus, *extra) -> int:
    return main(
        [
            "distill",
            "--base",
            str(tiny_base_dir),
            "--data",
            str(source),
            "--corpus",
            str(corpus),
            "--chunk",
            "2",
            "--max-new-tokens",
            "5",
            "--batch-size",
            "2",
            *extra,
        ]
    )


def test_a_corpus_grows_chunk_by_chunk_and_reads_as_a_source(tmp_path, tiny_base_dir, source, capsys):
    corpus_dir = tmp_path / "corpus"
    for _ in range(3):  # 2 + 2 + the last 1
        assert _distill(tiny_base_dir, source, corpus_dir) == 0
    corpus = Corpus.load(corpus_dir)
    assert [(c.start, c.end, c.conversations) for c in corpus.chunks] == [(0, 2, 2), (2, 4, 2), (4, 5, 1)]
    assert all(c.answers == c.conversations and c.answer_tokens > 0 for c in corpus.chunks)
    assert sorted(p.name for p in corpus_dir.iterdir()) == [
        MANIFEST,
        "part-00000.jsonl.gz",
        "part-00001.jsonl.gz",
        "part-00002.jsonl.gz",
    ]
    with pytest.raises(SystemExit, match="nothing after conversation 4: the corpus answers all of it"):
        _distill(tiny_base_dir, source, corpus_dir)
    assert len(list(corpus_dir.iterdir())) == 4  # no pending chunk left behind for the next run

    conversations, report = read_conversations(str(corpus_dir))
    assert [c.id for c in conversations] == ["c0", "c1", "c2", "c3", "c4"] and report.dropped == {}
    assert all(c.messages[-1]["content"] != "old" for c in conversations)  # the base's own answers

    # the same answers give the same bytes: a chunk re-distilled elsewhere has the same sha256
    again = tmp_path / "again"
    assert _distill(tiny_base_dir, source, again) == 0
    assert Corpus.load(again).chunks[0].sha256 == corpus.chunks[0].sha256

    # a sealed chunk that changed is refused, naming it; the pipeline's cache key follows the manifest
    identity = source_identity(str(corpus_dir), "train")
    with gzip.open(corpus_dir / "part-00001.jsonl.gz", "wt") as stream:
        stream.write(json.dumps(sharegpt_record("x", ("human", "h"), ("gpt", "g"))) + "\n")
    with pytest.raises(CorpusError, match="part-00001.jsonl.gz: sha256 .* differs"):
        read_conversations(str(corpus_dir))
    assert source_identity(str(corpus_dir), "train") == identity  # the manifest did not change


def test_an_interrupted_chunk_resumes_and_keeps_its_range(tmp_path, tiny_base_dir, source):
    corpus_dir = tmp_path / "corpus"
    assert _distill(tiny_base_dir, source, corpus_dir) == 0
    # a run that died after writing one of its conversations: the pending file and its range remain
    pending = {"start": 2, "end": 4, "seconds": 1.5, "engine": "hf"}
    (corpus_dir / "part-00001.pending.json").write_text(json.dumps(pending))
    record = sharegpt_record("c2", ("human", "question 2\u2028and"), ("gpt", "an answer kept from before"))
    (corpus_dir / "part-00001.jsonl").write_text(json.dumps(record) + "\n")
    assert _distill(tiny_base_dir, source, corpus_dir, "--chunk", "3") == 0  # the pending range wins
    chunk = Corpus.load(corpus_dir).chunks[1]
    assert (chunk.start, chunk.end, chunk.conversations) == (2, 4, 2) and chunk.seconds >= 1.5
    conversations, _ = read_conversations(str(corpus_dir))
    assert conversations[2].messages[-1]["content"] == "an answer kept from before"


def test_a_run_with_other_settings_is_refused(tmp_path, tiny_base_dir, source, capsys):
    corpus_dir = tmp_path / "corpus"
    assert _distill(tiny_base_dir, source, corpus_dir) == 0
    assert _distill(tiny_base_dir, source, corpus_dir, "--max-new-tokens", "7") == 3
    assert "field 'settings.max_new_tokens' is 5, this run's 7" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--limit does not apply"):
        _distill(tiny_base_dir, source, corpus_dir, "--limit", "3")
    assert len(Corpus.load(corpus_dir).chunks) == 1  # nothing was lost or added


def test_a_sampled_corpus_records_its_seed_and_refuses_another(tmp_path, tiny_base_dir, source, capsys):
    sampled = tmp_path / "sampled"
    assert _distill(tiny_base_dir, source, sampled, "--temperature", "0.7", "--seed", "3") == 0
    assert Corpus.load(sampled).settings.seed == 3
    assert _distill(tiny_base_dir, source, sampled, "--temperature", "0.7", "--seed", "4") == 3
    assert "field 'settings.seed' is 3, this run's 4" in capsys.readouterr().err
    assert len(Corpus.load(sampled).chunks) == 1

    # greedy answers do not depend on the seed: none is recorded, and any --seed extends the corpus
    greedy = tmp_path / "greedy"
    assert _distill(tiny_base_dir, source, greedy) == 0
    assert _distill(tiny_base_dir, source, greedy, "--seed", "5") == 0
    assert Corpus.load(greedy).settings.seed is None and len(Corpus.load(greedy).chunks) == 2
    # a manifest written before the seed was recorded (greedy) still reads
    manifest = json.loads((greedy / MANIFEST).read_text())
    del manifest["settings"]["seed"]
    (greedy / MANIFEST).write_text(json.dumps(manifest))
    assert Corpus.load(greedy).settings.seed is None


def test_bad_manifests_are_named(tmp_path):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / MANIFEST).write_text("{")
    with pytest.raises(CorpusError, match="manifest.json: not valid JSON"):
        Corpus.load(corpus_dir)
    (corpus_dir / MANIFEST).write_text(
        json.dumps({"format": "draftheads-corpus/1", "settings": {}, "chunks": []})
    )
    with pytest.raises(CorpusError, match="field 'settings': missing fields"):
        Corpus.load(corpus_dir)
    with pytest.raises(CorpusError, match="no manifest.json"):
        Corpus.load(tmp_path)


def test_a_corpus_of_answers_to_a_prompts_file(tmp_path, tiny_base_dir, capsys):
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"id": "p0", "turns": ["first", "and then?"]},
            {"id": "p1", "turns": ["second"]},
            {"prompt": "third"},
        ],
    )
    corpus_dir = tmp_path / "corpus"
    arguments = [
        "distill",
        "--base",
        str(tiny_base_dir),
        "--prompts",
        str(prompts),
        "--corpus",
        str(corpus_dir),
    ]
    arguments += ["--chunk", "2", "--max-new-tokens", "4", "--batch-size", "2"]
    assert main(arguments) == 0 and main(arguments) == 0
    corpus = Corpus.load(corpus_dir)
    assert [(c.start, c.end, c.answers) for c in corpus.chunks] == [(0, 2, 3), (2, 3, 1)]
    assert corpus.settings.source == str(prompts)
    conversations, _ = read_conversations(str(corpus_dir))
    assert sorted(c.id for c in conversations) == sorted(["p0", "p1", f"{prompts.name} line 3"])
    first = next(c for c in conversations if c.id == "p0")  # a chunk is written shortest first
    assert [m["role"] for m in first.messages] == ["user", "assistant", "user", "assistant"]
    assert first.messages[2]["content"] == "and then?"
    # a prompts file that changed under the corpus is refused before any work
    prompts.write_text(prompts.read_text() + json.dumps({"id": "p3", "turns": ["fourth"]}) + "\n")
    assert main(arguments) == 3
    assert "source_sha256" in capsys.readouterr().err
    assert len(Corpus.load(corpus_dir).chunks) == 2
