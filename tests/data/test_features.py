"""The hidden-state cache: what it stores, its size, resumption and refusal of stale caches."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from data_fixtures import load_root_conftest, make_byte_tokenizer

from draftheads.data import feature_reader, features
from draftheads.data.feature_identity import CacheIdentity, FeatureCacheError
from draftheads.data.feature_reader import FeatureCache
from draftheads.data.features import write_feature_cache
from draftheads.heads import build_head
from draftheads.heads.eagle3 import Eagle3Config
from draftheads.heads.medusa import MedusaConfig
from draftheads.heads.mtp import MtpConfig

make_tiny_llama = load_root_conftest().make_tiny_llama


def _rows(count=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (count,), generator=generator).tolist()
    ids = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "loss_mask": [[0, 0] + [1] * (n - 2) for n in lengths],
            "length": lengths,
            "id": [str(i) for i in range(count)],
        }
    )


@pytest.fixture
def splits():
    return {"train": _rows(7), "validation": _rows(3, seed=1)}


def _identity(model, head_config, splits, tokenizer=None):
    head = build_head(model, head_config)
    return CacheIdentity.build(model, "tiny", tokenizer, head, splits, max_length=64)


@torch.no_grad()
def _alone(model, ids):
    """hidden_states of one row run alone (no padding, no batch)."""
    return model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_stores_exactly_the_required_hidden_states(tmp_path, tiny_llama, splits):
    identity = _identity(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), splits)
    assert identity.hidden_state_layers == (1, 2, 3, 4)  # the 3 fused layers + hs[L] for the soft targets
    write_feature_cache(
        tiny_llama,
        splits,
        tmp_path,
        identity,
        dtype="float32",
        examples_per_shard=3,
        batch_size=2,
        progress=False,
    )
    cache = FeatureCache(tmp_path)
    for split, dataset in splits.items():
        for row in range(len(dataset)):
            input_ids, states = cache.row(split, row)
            assert input_ids.tolist() == dataset[row]["input_ids"]
            reference = _alone(tiny_llama, dataset[row]["input_ids"])
            assert sorted(states) == [1, 2, 3, 4]
            for layer, state in states.items():
                torch.testing.assert_close(state, reference[layer][0], rtol=1e-5, atol=1e-5)


def test_stores_the_base_argmax_where_the_next_token_is_supervised(tmp_path, tiny_llama, splits):
    """Computed before the states are rounded for storage: a bf16 cache holds the fp32 argmax;
    ``NO_ARGMAX`` where the next token is not supervised (the rows' first two tokens are not)."""
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(
        tiny_llama, splits, tmp_path, identity, examples_per_shard=3, batch_size=2, progress=False
    )
    cache = FeatureCache(tmp_path)
    rows = [2, 0, 5]  # across shards, out of order
    longest = max(len(splits["train"][row]["input_ids"]) for row in rows)
    input_ids = torch.zeros((len(rows), longest), dtype=torch.long)
    for position, row in enumerate(rows):
        ids = splits["train"][row]["input_ids"]
        input_ids[position, : len(ids)] = torch.tensor(ids)
    argmax = cache.base_argmax("train", rows, input_ids)
    assert argmax.shape == input_ids.shape
    for position, row in enumerate(rows):
        ids = splits["train"][row]["input_ids"]
        with torch.no_grad():
            expected = tiny_llama(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        supervised_next = torch.tensor(splits["train"][row]["loss_mask"][1:] + [0], dtype=torch.bool)
        assert torch.equal(argmax[position, : len(ids)][supervised_next], expected[supervised_next])
        assert (argmax[position, : len(ids)][~supervised_next] == feature_reader.NO_ARGMAX).all()
        assert not argmax[position, len(ids) :].any()  # padding


def test_a_cache_written_before_the_argmax_gives_none(tmp_path, tiny_llama, splits):
    from safetensors.torch import load_file, save_file

    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, identity, examples_per_shard=4, progress=False)
    old = feature_reader.shard_path(tmp_path, "train", 1)  # rows 4-6, as an older release wrote them
    tensors = load_file(old)
    del tensors[feature_reader.ARGMAX_KEY]
    save_file(tensors, old, metadata={"format": "pt"})
    cache = FeatureCache(tmp_path)
    ids = lambda row: torch.tensor([splits["train"][row]["input_ids"]])
    assert cache.base_argmax("train", [1], ids(1)) is not None
    assert cache.base_argmax("train", [5], ids(5)) is None
    assert cache.batch("train", [5], ids(5), torch.float32)[4].shape[1] == ids(5).shape[1]  # still read


def test_bf16_cache_size_matches_the_estimate(tmp_path, tiny_llama, splits, capsys):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    summary = write_feature_cache(tiny_llama, splits, tmp_path, identity, progress=False)
    tokens = sum(sum(d["length"]) for d in splits.values())
    per_token = 64 * 2 + 4 + 4  # hs[L] in bf16 + the int32 token id and argmax
    assert summary.tokens == tokens and summary.estimated_bytes == tokens * per_token
    # Actual = estimate + safetensors headers, offsets and the index: small on any real cache.
    assert summary.estimated_bytes < summary.actual_bytes < summary.estimated_bytes + 8_000
    output = capsys.readouterr().out
    assert "about" in output and "bytes/token" in output and "on disk" in output
    _, states = FeatureCache(tmp_path).row("train", 0)
    assert states[4].dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits of the fp32 states.
    reference = _alone(tiny_llama, splits["train"][0]["input_ids"])[4][0]
    torch.testing.assert_close(states[4].float(), reference, rtol=1e-2, atol=1e-2)


def test_a_cache_computed_in_bf16_serves_the_fp32_base(tmp_path, splits):
    """``cache-features --compute-dtype bfloat16``: the identity is the fp32 base's, taken before the
    cast, so training against that base reads the cache; the index records the dtype the base ran
    in, and a resumed write must run in it too."""
    head_config = Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64)
    model = make_tiny_llama()
    identity = _identity(model, head_config, splits)
    model.to(torch.bfloat16)
    write_feature_cache(model, splits, tmp_path / "bf16", identity, examples_per_shard=4, progress=False)
    cache = FeatureCache(tmp_path / "bf16")
    cache.check(_identity(make_tiny_llama(), head_config, splits))  # the fp32 run reads it
    assert feature_reader.read_index(tmp_path / "bf16")["compute_dtype"] == "bfloat16"
    write_feature_cache(make_tiny_llama(), splits, tmp_path / "fp32", identity, progress=False)
    assert feature_reader.read_index(tmp_path / "fp32")["compute_dtype"] == "float32"
    _, bf16_states = cache.row("train", 0)
    _, fp32_states = FeatureCache(tmp_path / "fp32").row("train", 0)
    for layer in (1, 2, 3, 4):  # close, and computed otherwise than the fp32 forward's rounding
        torch.testing.assert_close(bf16_states[layer].float(), fp32_states[layer].float(), rtol=0.1, atol=0.1)
    assert any(not torch.equal(bf16_states[layer], fp32_states[layer]) for layer in (1, 2, 3, 4))
    feature_reader.shard_path(tmp_path / "bf16", "train", 1).unlink()  # an interrupted write
    with pytest.raises(FeatureCacheError, match="compute_dtype='bfloat16'.*got 'float32'"):
        write_feature_cache(
            make_tiny_llama(), splits, tmp_path / "bf16", identity, examples_per_shard=4, progress=False
        )


def test_an_interrupted_write_resumes_after_the_last_complete_shard(
    tmp_path, tiny_llama, splits, monkeypatch
):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    options = {"dtype": "float32", "examples_per_shard": 2, "batch_size": 3, "progress": False}
    whole = write_feature_cache(tiny_llama, splits, tmp_path / "whole", identity, **options)
    assert whole.written_examples == 10

    calls = []
    original = features._write_shard

    def failing(path, *args):
        calls.append(path.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while writing the third shard
        original(path, *args)

    monkeypatch.setattr(features, "_write_shard", failing)
    with pytest.raises(KeyboardInterrupt):
        write_feature_cache(tiny_llama, splits, tmp_path / "resumed", identity, **options)
    index = json.loads((tmp_path / "resumed" / "index.json").read_text())
    assert index["complete_shards"] == {"train": 2, "validation": 0}
    with pytest.raises(FeatureCacheError, match="incomplete: 2 of 4 'train' shards"):
        FeatureCache(tmp_path / "resumed")
    monkeypatch.setattr(features, "_write_shard", original)
    resumed = write_feature_cache(tiny_llama, splits, tmp_path / "resumed", identity, **options)
    assert resumed.written_examples == 10 - 4
    for split in ("train", "validation"):
        for path in sorted((tmp_path / "whole" / split).iterdir()):
            assert path.read_bytes() == (tmp_path / "resumed" / split / path.name).read_bytes(), path


def test_a_cache_grows_when_rows_are_added_after_its_own(tmp_path, tiny_llama, splits, capsys):
    head = MedusaConfig(num_heads=2)
    options = {"dtype": "float32", "examples_per_shard": 2, "progress": False}
    cache = tmp_path / "cache"
    write_feature_cache(tiny_llama, splits, cache, _identity(tiny_llama, head, splits), **options)
    full_shards = {path.name: path.read_bytes() for path in sorted((cache / "train").iterdir())[:3]}

    # an extra source's rows follow the cached training rows (7 rows: 3 full shards and row 6 alone)
    more = datasets.concatenate_datasets([splits["train"], _rows(4, seed=2)])
    grown = {"train": more, "validation": splits["validation"]}
    identity = _identity(tiny_llama, head, grown)
    summary = write_feature_cache(tiny_llama, grown, cache, identity, **options)
    assert summary.written_examples == 5  # row 6's partial shard again, and the 4 new rows
    assert "split 'train' grew from 7 to 11 rows; keeping its first 3 shards" in capsys.readouterr().out
    for name, content in full_shards.items():
        assert (cache / "train" / name).read_bytes() == content, name
    FeatureCache(cache).check(identity)
    # the same bytes as a cache written from the start with every row
    write_feature_cache(tiny_llama, grown, tmp_path / "fresh", identity, **options)
    for path in sorted((tmp_path / "fresh" / "train").iterdir()):
        assert path.read_bytes() == (cache / "train" / path.name).read_bytes(), path

    # rows that do not begin with the cache's are another data set: refused, naming the rows
    other = {"train": _rows(11, seed=5), "validation": splits["validation"]}
    with pytest.raises(FeatureCacheError, match="rows"):
        write_feature_cache(tiny_llama, other, cache, _identity(tiny_llama, head, other), **options)
    # so is a grown split whose other fields differ (here the held-out rows)
    moved = {"train": more, "validation": _rows(3, seed=7)}
    with pytest.raises(FeatureCacheError, match="rows"):
        write_feature_cache(tiny_llama, moved, cache, _identity(tiny_llama, head, moved), **options)


def test_resuming_with_other_settings_is_refused(tmp_path, tiny_llama, splits):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, identity, examples_per_shard=4, progress=False)
    with pytest.raises(FeatureCacheError, match="examples_per_shard=4"):
        write_feature_cache(tiny_llama, splits, tmp_path, identity, examples_per_shard=2, progress=False)
    eagle3 = _identity(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), splits)
    with pytest.raises(FeatureCacheError, match="head kind"):
        write_feature_cache(tiny_llama, splits, tmp_path, eagle3, examples_per_shard=4, progress=False)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("other base weights", "base_weights_hash"),
        ("other base config", "base_config_hash"),
        ("other tokenizer", "tokenizer_hash"),
        (
            "feature layers the cache lacks",
            r"lacks hidden states \[0\].*hidden_state_layers is \[1, 2, 3, 4\]",
        ),
        ("other rows", "rows"),
    ],
)
def test_a_stale_cache_is_refused_naming_the_field(tmp_path, tiny_llama, splits, change, field):
    tokenizer = make_byte_tokenizer()
    identity = _identity(
        tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), splits, tokenizer
    )
    write_feature_cache(tiny_llama, splits, tmp_path, identity, progress=False)
    cache = FeatureCache(tmp_path)
    cache.check(identity)  # the same run is accepted

    model, head_config, rows = tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), splits
    if change == "other base weights":
        model = make_tiny_llama(seed=1)
    elif change == "other base config":
        model = make_tiny_llama(rms_norm_eps=1e-5)
    elif change == "other tokenizer":
        tokenizer = make_byte_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    elif change == "feature layers the cache lacks":
        head_config = Eagle3Config(feature_layers=(0, 2, 3), draft_vocab_size=64)
    else:
        rows = {"train": _rows(7, seed=5), "validation": splits["validation"]}
    with pytest.raises(FeatureCacheError, match=field):
        cache.check(_identity(model, head_config, rows, tokenizer))


def test_a_cache_serves_any_head_whose_hidden_states_it_holds(tmp_path, tiny_llama, splits):
    eagle3 = _identity(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, eagle3, progress=False)
    cache = FeatureCache(tmp_path)
    for head_config in (MtpConfig(num_modules=1), MedusaConfig(num_heads=2)):  # both read hs[4] only
        cache.check(_identity(tiny_llama, head_config, splits))
    rows = splits["train"]
    input_ids = torch.tensor([rows[0]["input_ids"]])
    assert set(cache.batch("train", [0], input_ids, torch.float32, layers=(4,))) == {4}
    assert set(cache.batch("train", [0], input_ids, torch.float32)) == {1, 2, 3, 4}


def test_rows_that_differ_from_the_batch_are_refused(tmp_path, tiny_llama, splits):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, identity, progress=False)
    cache = FeatureCache(tmp_path)
    ids = torch.tensor([splits["train"][1]["input_ids"]])
    assert cache.batch("train", [1], ids, torch.float32)[4].shape == (1, ids.shape[1], 64)
    with pytest.raises(FeatureCacheError, match="row 0 of 'train' holds other tokens"):
        cache.batch("train", [0], ids, torch.float32)


def test_no_index_is_a_clear_error(tmp_path):
    with pytest.raises(FeatureCacheError, match="holds no feature cache.*cache-features"):
        FeatureCache(tmp_path)


def test_a_damaged_shard_is_named(tmp_path, tiny_llama, splits):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, identity, progress=False)
    shard = min(tmp_path.glob("**/*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:40])  # cut short: the header promises more
    with pytest.raises(FeatureCacheError, match=f"shard {shard}.* is damaged"):
        FeatureCache(tmp_path).row(shard.parent.name, 0)  # shards live in <split>/


def test_a_reader_keeps_a_bounded_number_of_shards_open(tmp_path, tiny_llama, splits, monkeypatch):
    identity = _identity(tiny_llama, MedusaConfig(num_heads=2), splits)
    write_feature_cache(tiny_llama, splits, tmp_path, identity, examples_per_shard=2, progress=False)
    monkeypatch.setattr(feature_reader, "MAX_OPEN_SHARDS", 2)
    cache = FeatureCache(tmp_path)
    first = [cache.row("train", row) for row in range(7)]  # 4 shards of 2 rows
    path = [feature_reader.shard_path(tmp_path, "train", shard) for shard in range(4)]
    assert list(cache._shards) == [path[2], path[3]]
    third = cache._shards[path[3]][0]
    cache.row("train", 4)  # shard 2: now the most recently read
    cache.row("train", 0)  # shard 0 again: shard 3, the least recently read, is closed
    assert list(cache._shards) == [path[2], path[0]]
    assert third._fd == -1
    again = [cache.row("train", row) for row in reversed(range(7))][::-1]  # closed shards reopen
    for (ids, states), (ids_again, states_again) in zip(first, again):
        assert torch.equal(ids, ids_again) and all(torch.equal(states[k], states_again[k]) for k in states)
