"""build_datasets: rows, truncation and drops, deterministic split, cache hits."""

from __future__ import annotations

import pytest
from data_fixtures import sharegpt_record, write_jsonl

from draftheads.config import DataConfig
from draftheads.data.pipeline import DataReport, build_datasets, length_histogram
from draftheads.data.sources import DataError
from draftheads.settings import ConfigError


@pytest.fixture
def source(tmp_path):
    records = [
        sharegpt_record(f"c{i}", ("human", f"question {i}"), ("gpt", f"answer number {i}")) for i in range(30)
    ]
    records.append(sharegpt_record("long-question", ("human", "q" * 500), ("gpt", "late answer")))
    records.append('{"broken json')
    return write_jsonl(tmp_path / "chats.jsonl", records)


def config(source, tmp_path, **overrides) -> DataConfig:
    values = {
        "source": str(source),
        "validation_size": 5,
        "max_length": 160,
        "cache_dir": str(tmp_path / "cache"),
    }
    return DataConfig(**{**values, **overrides})


def test_rows_report_and_drops(source, tmp_path, byte_tokenizer):
    train, validation, report = build_datasets(config(source, tmp_path), byte_tokenizer, "tiny")
    assert len(train) == 25 and len(validation) == 5
    assert set(train.column_names) == {"input_ids", "loss_mask", "length", "id"}
    for row in train:
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["length"] <= 160
        assert sum(row["loss_mask"]) > 0
    assert report.conversations_read == 32 and report.conversations_valid == 31 and report.examples == 30
    assert report.dropped == {"invalid_json": 1, "no_supervised_tokens": 1}
    assert report.drop_examples["no_supervised_tokens"] == [
        "id long-question: no assistant token within the first 160 tokens"
    ]
    assert report.drop_examples["invalid_json"][0].startswith("chats.jsonl line 32:")
    assert report.tokens == sum(train["length"]) + sum(validation["length"])
    assert 0 < report.assistant_share < 1 and report.mask_methods == {"prefix": 30}
    assert sum(count for _, _, count in report.length_histogram) == 30
    assert DataReport.from_json(report.to_json()) == report


def test_split_is_deterministic_and_seeded(source, tmp_path, byte_tokenizer):
    first = build_datasets(config(source, tmp_path / "a"), byte_tokenizer, "tiny")
    again = build_datasets(config(source, tmp_path / "b"), byte_tokenizer, "tiny")
    other = build_datasets(config(source, tmp_path / "c", seed=1), byte_tokenizer, "tiny")
    assert first[1]["id"] == again[1]["id"] and first[0]["id"] == again[0]["id"]
    assert set(first[1]["id"]) != set(other[1]["id"])
    assert set(first[0]["id"]).isdisjoint(first[1]["id"])


def test_second_build_hits_the_cache(source, tmp_path, byte_tokenizer):
    train, validation, report = build_datasets(config(source, tmp_path), byte_tokenizer, "tiny")
    assert not report.cache_hit
    train2, validation2, report2 = build_datasets(config(source, tmp_path), byte_tokenizer, "tiny")
    assert report2.cache_hit and report2.cache_path == report.cache_path
    assert train2["input_ids"] == train["input_ids"] and validation2["id"] == validation["id"]
    assert report2.dropped == report.dropped and report2.tokens == report.tokens
    # anything that shapes the rows changes the key: max_length, or the source file itself
    assert not build_datasets(config(source, tmp_path, max_length=150), byte_tokenizer, "tiny")[2].cache_hit
    source.write_text(source.read_text() + "\n")
    assert not build_datasets(config(source, tmp_path), byte_tokenizer, "tiny")[2].cache_hit


def test_limit_and_bad_validation_size(source, tmp_path, byte_tokenizer):
    train, validation, report = build_datasets(config(source, tmp_path, limit=10), byte_tokenizer, "tiny")
    assert report.conversations_valid == 10 and len(train) + len(validation) == 10
    with pytest.raises(DataError, match="validation_size=10 leaves no training examples out of 10"):
        build_datasets(config(source, tmp_path, limit=10, validation_size=10), byte_tokenizer, "tiny")


def test_skip_passes_over_the_first_conversations(source, tmp_path, byte_tokenizer):
    skipped = config(source, tmp_path, skip=10, limit=12)
    train, validation, report = build_datasets(skipped, byte_tokenizer, "tiny")
    ids = sorted([*train["id"], *validation["id"]], key=lambda i: int(i[1:]))
    assert ids == [f"c{i}" for i in range(10, 22)]
    assert report.conversations_valid == 12 and not report.cache_hit
    # the same limit without the skip is other rows, not a cache hit on these
    unskipped = build_datasets(config(source, tmp_path, limit=12), byte_tokenizer, "tiny")
    assert not unskipped[2].cache_hit and "c0" in [*unskipped[0]["id"], *unskipped[1]["id"]]
    with pytest.raises(DataError, match="data.skip is 31, but .* has 31 usable conversations"):
        build_datasets(config(source, tmp_path, skip=31), byte_tokenizer, "tiny")
    with pytest.raises(ConfigError, match="data.skip must be >= 0, got -1"):
        build_datasets(config(source, tmp_path, skip=-1), byte_tokenizer, "tiny")


def test_extra_sources_join_the_training_split_only(source, tmp_path, byte_tokenizer):
    alone = build_datasets(config(source, tmp_path), byte_tokenizer, "tiny")
    held_out = alone[1]["id"][0]
    extra = write_jsonl(
        tmp_path / "more.jsonl",
        [sharegpt_record(f"m{i}", ("human", f"more {i}"), ("gpt", f"more answer {i}")) for i in range(10)]
        # another answer to a held-out conversation: left out, or its prompt would leak into training
        + [sharegpt_record(held_out, ("human", "the same question"), ("gpt", "another answer"))]
        + ['{"broken'],
    )
    train, validation, report = build_datasets(
        config(source, tmp_path, extra_sources=(str(extra),)), byte_tokenizer, "tiny"
    )
    # data.source's rows first, as without the extra source (a feature cache of them stays valid),
    # then every example of the extra source in its order; the held-out split is unchanged
    assert list(train["id"]) == list(alone[0]["id"]) + [f"m{i}" for i in range(10)]
    assert list(validation["id"]) == list(alone[1]["id"])
    assert report.train_examples == 35 and report.examples == 40
    assert report.tokens == sum(train["length"]) + sum(validation["length"])
    assert report.extra_sources == [
        {
            "source": report.extra_sources[0]["source"],
            "conversations_read": 12,
            "examples": 10,
            "tokens": sum(train["length"][25:]),
            "assistant_tokens": sum(sum(mask) for mask in train.select(range(25, 35))["loss_mask"]),
            "dropped": {"invalid_json": 1, "held_out_id": 1},
        }
    ]
    assert "more.jsonl" in report.extra_sources[0]["source"]
    # a second build hits both caches and gives the same rows
    again = build_datasets(config(source, tmp_path, extra_sources=(str(extra),)), byte_tokenizer, "tiny")
    assert list(again[0]["id"]) == list(train["id"]) and again[2].extra_sources == report.extra_sources
    # a bad extra source is named by its place in the list
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"data.extra_sources\[1\]: .*nope.jsonl"):
        build_datasets(config(source, tmp_path, extra_sources=(str(extra), missing)), byte_tokenizer, "tiny")
    with pytest.raises(ConfigError, match=r"data.extra_sources\[0\] is .*other than data.source"):
        build_datasets(config(source, tmp_path, extra_sources=(str(source),)), byte_tokenizer, "tiny")


def test_length_histogram_bins_cover_zero_to_max_length():
    bins = length_histogram([0, 1, 99, 100, 255, 256], 256, bins=4)
    assert bins == [(0, 64, 2), (64, 128, 2), (128, 192, 0), (192, 257, 2)]
