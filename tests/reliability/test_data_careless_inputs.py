"""Data files as careless users write them: a malformed record mid-array, bytes that are not UTF-8,
gzip, a byte-order mark, nonsense limits, a build interrupted or broken in the cache."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from draftheads.cli import main
from draftheads.config import DataConfig, load_run_config
from draftheads.data import sources
from draftheads.data.pipeline import build_datasets
from draftheads.data.sources import DataError, read_conversations
from draftheads.settings import ConfigError
from tests.data.data_fixtures import make_byte_tokenizer, save_tiny_base, sharegpt_record, write_jsonl

BAD_RECORD = '{"id": "r10", "conversations": [{"from": "human", "value": "q"},, ]}'  # double comma


def records(count: int) -> list[dict]:
    return [
        sharegpt_record(f"r{i}", ("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(count)
    ]


def json_array(items: list, indent: int | None = None) -> str:
    """A JSON array text of ``items``: dicts are dumped, strings go in verbatim (malformed ones)."""
    separator = ",\n" if indent else ", "
    pad = " " * (indent or 0)
    return (
        "["
        + ("\n" if indent else "")
        + separator.join(pad + (item if isinstance(item, str) else json.dumps(item)) for item in items)
        + ("\n" if indent else "")
        + "]\n"
    )


@pytest.fixture(scope="module")
def byte_tokenizer():
    return make_byte_tokenizer()


# ---- a malformed record in the middle of a JSON array --------------------------------------------


@pytest.mark.parametrize("indent", [None, 2])
def test_one_malformed_record_mid_array_is_dropped_and_the_rest_read(tmp_path, indent):
    items = records(40)
    items[10] = BAD_RECORD
    path = tmp_path / "chats.json"
    path.write_text(json_array(items, indent))
    conversations, report = read_conversations(str(path))
    assert len(conversations) == 39 and "r11" in {c.id for c in conversations}
    assert report.records == 40 and report.truncated_tail is None
    assert report.dropped == {"invalid_json": 1}
    example = report.examples["invalid_json"][0]
    where = "line 12" if indent else "line 1"
    assert example.startswith(f"chats.json record 10 ({where}"), example
    assert "Expecting value" in example


BROKEN_RECORDS = {
    "missing_brace": '{"id": "rX", "conversations": [{"from": "human", "value": "q"}]',
    "unbalanced_quote": '{"id": "rX, "conversations": [{"from": "human", "value": "q"}]}',
    "extra_bracket": '{"id": "rX", "conversations": [[{"from": "human", "value": "q"}]}',
    "single_quotes": "{'id': 'rX', 'conversations': []}",
}


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("index", [10, 39])
@pytest.mark.parametrize("broken", sorted(BROKEN_RECORDS))
def test_a_record_with_unbalanced_brackets_or_quotes_costs_only_itself(tmp_path, broken, index, indent):
    items = records(40)
    items[index] = BROKEN_RECORDS[broken]
    path = tmp_path / "chats.json"
    path.write_text(json_array(items, indent))
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == [f"r{i}" for i in range(40) if i != index]
    assert report.records == 40 and report.dropped == {"invalid_json": 1}
    assert report.truncated_tail is None
    assert report.examples["invalid_json"][0].startswith(f"chats.json record {index} (line ")


def test_a_really_truncated_array_is_still_a_truncated_tail(tmp_path):
    text = json_array(records(5), indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"answer 4"')])
    conversations, report = read_conversations(str(path))
    assert len(conversations) == 4 and report.dropped == {}
    assert report.truncated_tail is not None and report.truncated_tail.bytes_skipped > 0


def test_too_many_drops_are_an_error_naming_file_count_and_share(tmp_path, byte_tokenizer):
    items = records(20)
    for index in (3, 7, 11):
        items[index] = BAD_RECORD.replace("r10", f"r{index}")
    path = tmp_path / "chats.json"
    path.write_text(json_array(items))
    data = DataConfig(source=str(path), validation_size=2, max_length=128, cache_dir=str(tmp_path / "c"))
    with pytest.raises(
        DataError, match=r"chats.json: 3 of 20 records dropped \(15\.0%\).*max_drop_fraction=0.1"
    ):
        build_datasets(data, byte_tokenizer, "tiny")
    data.max_drop_fraction = 0.2
    train, validation, report = build_datasets(data, byte_tokenizer, "tiny")
    assert len(train) + len(validation) == 17 and report.dropped == {"invalid_json": 3}
    data.max_drop_fraction = 0.1  # the threshold does not key the cache: a hit is checked too
    with pytest.raises(DataError, match=r"3 of 20 records dropped"):
        build_datasets(data, byte_tokenizer, "tiny")


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"))


def train_config(tmp_path, tiny_base, source) -> str:
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model:\n  base: {tiny_base}\nhead:\n  kind: medusa\n  num_heads: 1\n"
        f"data:\n  source: {source}\n  validation_size: 2\n  max_length: 256\n"
        f"  cache_dir: {tmp_path / 'cache'}\n"
        f"train:\n  output_dir: {tmp_path / 'run'}\n  max_steps: 1\n  warmup_steps: 0\n"
        "  eval_batches: 1\n  base_throughput_batches: 0\n  micro_batch_size: 2\n"
    )
    return str(config)


def test_train_refuses_too_many_drops_naming_them(tmp_path, tiny_base, capsys):
    items = records(20)
    for index in (3, 7, 11):
        items[index] = BAD_RECORD.replace("r10", f"r{index}")
    path = tmp_path / "chats.json"
    path.write_text(json_array(items))
    assert main(["train", "--config", train_config(tmp_path, tiny_base, path)]) == 3
    captured = capsys.readouterr()
    assert captured.err.startswith("draftheads train:")  # the refusal, on stderr; the summary on stdout
    out = captured.out + captured.err
    assert "chats.json: 3 of 20 records dropped (15.0%)" in out
    assert "invalid_json 3" in out and "chats.json record 3 (line 1)" in out
    assert not (tmp_path / "run").exists()


def test_train_prints_the_drop_summary_as_data_inspect_does(tmp_path, tiny_base, capsys):
    items = records(20)
    items[3] = BAD_RECORD.replace("r10", "r3")
    path = tmp_path / "chats.json"
    path.write_text(json_array(items))
    config = train_config(tmp_path, tiny_base, path)
    assert main(["data", "inspect", "--config", config]) == 0
    inspected = capsys.readouterr().out
    assert main(["train", "--config", config]) == 0
    trained = capsys.readouterr().out
    summary = inspected[: inspected.index("tokens:")]
    assert "conversations read: 20" in summary and "invalid_json: 1" in summary
    assert "e.g. chats.json record 3 (line 1)" in summary
    assert summary in trained


# ---- bytes that are not UTF-8, gzip, a byte-order mark -------------------------------------------


def test_a_non_utf8_line_in_jsonl_is_dropped_with_its_line_and_offset(tmp_path):
    lines = [json.dumps(r).encode() for r in records(5)]
    lines[2] = lines[2].replace(b"question 2", b"question \xe9 2")
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["r0", "r1", "r3", "r4"]
    assert report.dropped == {"not_utf8": 1}
    offset = path.read_bytes().index(b"\xe9")
    assert report.examples["not_utf8"] == [
        f"latin.jsonl line 3: byte 0xe9 at byte offset {offset} is not UTF-8"
    ]


def test_a_non_utf8_record_in_a_json_array_is_dropped_with_its_offset(tmp_path):
    text = json_array(records(5), indent=2).encode()
    text = text.replace(b"answer 3", b"answer \xff 3")
    path = tmp_path / "latin.json"
    path.write_bytes(text)
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["r0", "r1", "r2", "r4"]
    assert report.dropped == {"not_utf8": 1}
    offset = text.index(b"\xff")
    assert report.examples["not_utf8"] == [
        f"latin.json record 3 (line 5): byte 0xff at byte offset {offset} is not UTF-8"
    ]


@pytest.mark.parametrize("name", ["chats.json.gz", "chats.jsonl.gz"])
def test_gzipped_json_array_and_json_lines_are_read(tmp_path, name):
    items = records(6)
    text = (
        json_array(items, indent=2)
        if name.startswith("chats.json.")
        else "".join(json.dumps(r) + "\n" for r in items)
    )
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()))
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == [f"r{i}" for i in range(6)] and report.dropped == {}


def test_a_gzipped_array_cut_short_is_a_truncated_tail(tmp_path):
    text = json_array(records(5), indent=2)
    path = tmp_path / "cut.json.gz"
    path.write_bytes(gzip.compress(text[: text.index('"answer 4"')].encode()))
    conversations, report = read_conversations(str(path))
    assert len(conversations) == 4 and report.truncated_tail is not None


def test_a_corrupt_gzip_file_is_named(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records(50)))[:60])
    with pytest.raises(DataError, match=r"broken.jsonl.gz: cannot decompress"):
        read_conversations(str(path))


def test_gzipped_parquet_is_refused_by_name(tmp_path):
    path = tmp_path / "rows.parquet.gz"
    path.write_bytes(gzip.compress(b"PAR1"))
    with pytest.raises(DataError, match=r"rows.parquet.gz: gzipped Parquet cannot be read; gunzip it"):
        read_conversations(str(path))


@pytest.mark.parametrize("name", ["bom.jsonl", "bom.json", "bom_array.json"])
def test_a_byte_order_mark_is_accepted(tmp_path, name):
    items = records(3)
    text = json_array(items) if name == "bom_array.json" else "".join(json.dumps(r) + "\n" for r in items)
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    conversations, report = read_conversations(str(path))
    assert [c.id for c in conversations] == ["r0", "r1", "r2"] and report.dropped == {}


# ---- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.limit=0", "data.limit must be >= 1 (or null for every conversation), got 0"),
        ("data.limit=-1", "data.limit must be >= 1 (or null for every conversation), got -1"),
        ("data.validation_size=0", "data.validation_size must be >= 1"),
        ("data.max_drop_fraction=1.5", "data.max_drop_fraction must be in [0, 1], got 1.5"),
        ("data.max_length=1", "data.max_length must be >= 2, got 1"),
    ],
)
def test_nonsense_data_settings_are_refused_by_name(override, message):
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        load_run_config(None, [override])


def test_json_error_messages_read_once():
    with pytest.raises(json.JSONDecodeError) as caught:
        json.loads('{"a": "unterminated')
    assert sources.describe_json_error(caught.value) == "Unterminated string starting at column 7"
    with pytest.raises(json.JSONDecodeError) as caught:
        json.loads('{"a" 1}')
    assert sources.describe_json_error(caught.value) == "Expecting ':' delimiter at column 6"


# ---- the datasets cache --------------------------------------------------------------------------


def test_a_broken_cache_entry_is_discarded_and_rebuilt(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", records(12))
    data = DataConfig(source=str(path), validation_size=2, max_length=128, cache_dir=str(tmp_path / "c"))
    _, _, report = build_datasets(data, byte_tokenizer, "tiny")
    entry = tmp_path / "c" / report.cache_path.rsplit("/", 1)[1]
    for arrow in (entry / "validation").glob("*.arrow"):
        arrow.write_bytes(b"not arrow")  # a disk error, a copy cut short
    with pytest.warns(UserWarning, match=f"{entry} is unreadable") as caught:
        train, validation, again = build_datasets(data, byte_tokenizer, "tiny")
    assert not again.cache_hit and len(train) == 10 and len(validation) == 2
    assert caught[0].filename == __file__  # the warning points at the caller
    assert build_datasets(data, byte_tokenizer, "tiny")[2].cache_hit


def test_an_entry_without_its_report_is_rebuilt(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", records(12))
    data = DataConfig(source=str(path), validation_size=2, max_length=128, cache_dir=str(tmp_path / "c"))
    _, _, report = build_datasets(data, byte_tokenizer, "tiny")
    entry = tmp_path / "c" / report.cache_path.rsplit("/", 1)[1]
    (entry / "report.json").unlink()  # what a build writing in place and killed midway leaves
    with pytest.warns(UserWarning, match=r"is incomplete \(no report.json\); removing it"):
        train, _, again = build_datasets(data, byte_tokenizer, "tiny")
    assert not again.cache_hit and len(train) == 10


def test_validation_size_zero_is_refused_before_anything_is_cached(tmp_path, byte_tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", records(12))
    data = DataConfig(source=str(path), validation_size=0, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match="data.validation_size must be >= 1"):
        build_datasets(data, byte_tokenizer, "tiny")
    assert not (tmp_path / "c").exists()


# ---- a base model without a chat template --------------------------------------------------------


@pytest.fixture(scope="module")
def base_without_template(tmp_path_factory):
    directory = save_tiny_base(tmp_path_factory.mktemp("no_template"))
    for path in directory.glob("chat_template.*"):
        path.unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("command", ["distill", "synth-prompts"])
def test_a_base_without_a_chat_template_is_one_line_naming_it(
    tmp_path, base_without_template, command, capsys
):
    """synth-prompts always needs a template; distill when asked for one (--template chat)."""
    options = ["--base", str(base_without_template), "--out", str(tmp_path / "out.jsonl")]
    if command == "distill":
        options += ["--data", str(write_jsonl(tmp_path / "chats.jsonl", records(2))), "--template", "chat"]
        start = "draftheads distill: --template=chat, but the tokenizer of"
    else:
        options += ["--count", "2", "--max-new-tokens", "4"]
        start = f"draftheads {command}: base model {base_without_template} has no chat template"
    assert main([command, *options]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start) and "chat_template.jinja" in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_distill_renders_plain_text_for_a_base_without_a_chat_template(
    tmp_path, base_without_template, capsys
):
    """--template auto (the default) is plain for such a base: answers are written, the settings
    record the choice, and continuing the output with another one is refused."""
    out = tmp_path / "out.jsonl"
    options = ["--base", str(base_without_template), "--out", str(out), "--max-new-tokens", "4"]
    options += ["--data", str(write_jsonl(tmp_path / "chats.jsonl", records(2)))]
    assert main(["distill", *options]) == 0
    assert len(out.read_text().splitlines()) == 2
    assert json.loads(Path(f"{out}.settings.json").read_text())["template"] == "auto"
    capsys.readouterr()
    assert main(["distill", *options, "--template", "chat"]) != 0
    assert "field 'template' is 'auto'" in capsys.readouterr().err


# ---- a malformed line in a directory of files, or in one file -----------------------------------


def test_a_malformed_line_in_a_directory_costs_one_record_with_a_warning_naming_it(tmp_path):
    directory = tmp_path / "chats"
    (directory / "more").mkdir(parents=True)
    items = records(8)
    write_jsonl(directory / "a.jsonl", items[:4])
    write_jsonl(directory / "more" / "b.jsonl", items[4:6] + [BAD_RECORD] + items[6:])
    with pytest.warns(UserWarning, match=r"more/b\.jsonl line 3: invalid_json \(Expecting value") as caught:
        conversations, report = read_conversations(str(directory))
    assert [c.id for c in conversations] == [f"r{i}" for i in range(8)]
    assert report.records == 9 and report.dropped == {"invalid_json": 1}
    assert len(caught) == 1 and caught[0].filename == __file__  # the warning points at the caller


def test_a_directory_honours_the_split_its_file_names_give(tmp_path):
    directory = tmp_path / "chats"
    directory.mkdir()
    write_jsonl(directory / "train.jsonl", records(3))
    write_jsonl(directory / "test.jsonl", [BAD_RECORD] + records(5)[3:])
    assert [c.id for c in read_conversations(str(directory))[0]] == ["r0", "r1", "r2"]
    with pytest.warns(UserWarning, match=r"test\.jsonl line 1"):
        assert [c.id for c in read_conversations(str(directory), split="test")[0]] == ["r3", "r4"]
    with pytest.raises(DataError, match=rf"{directory}: no split 'validation'; it has \['test', 'train'\]"):
        read_conversations(str(directory), split="validation")


def test_a_malformed_line_in_one_file_is_warned_about_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", records(3) + [BAD_RECORD])
    with pytest.warns(UserWarning, match=rf"{path} line 4: invalid_json \(Expecting"):
        conversations, report = read_conversations(str(path))
    assert len(conversations) == 3 and report.dropped == {"invalid_json": 1}


def test_a_directory_with_nothing_usable_fails_naming_the_file(tmp_path, byte_tokenizer):
    directory = tmp_path / "chats"
    directory.mkdir()
    write_jsonl(directory / "only.jsonl", [BAD_RECORD])
    data = DataConfig(source=str(directory), validation_size=1, cache_dir=str(tmp_path / "c"))
    with pytest.warns(UserWarning), pytest.raises(DataError, match=r"only\.jsonl line 1: Expecting value"):
        build_datasets(data, byte_tokenizer, "tiny")
