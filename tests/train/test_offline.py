"""Offline training: the same batch gives the same loss from cached hidden states as online."""

from __future__ import annotations

import datasets
import pytest
import torch

from draftheads.config import load_run_config
from draftheads.data.feature_identity import CacheIdentity, FeatureCacheError
from draftheads.data.features import write_feature_cache
from draftheads.heads import DFlashConfig, Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.train.batching import fixed_batches
from draftheads.train.hidden_states import OnlineHiddenStates, open_feature_cache
from draftheads.train.initial_head import supervised_token_counts
from draftheads.train.loop import run_training
from draftheads.train.objective import compute_objective
from draftheads.train.reporting import read_metrics

HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=2, num_layers=1),
    "eagle": EagleConfig(),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=2),
    "mtp": MtpConfig(num_modules=2),
    # the base's argmax as its targets: the one other objective a cache's stored argmax serves
    "dflash": DFlashConfig(num_layers=1, block_size=4, feature_layers=(1, 2, 3), targets="base"),
}
HEAD_OVERRIDES = {
    "medusa": ["head.kind=medusa", "head.num_heads=2"],
    "eagle3": [
        "head.kind=eagle3",
        "head.feature_layers=[1,2,3]",
        "head.draft_vocab_size=64",
        "head.ttt_steps=2",
    ],
}
# An fp32 cache reproduces the online loss exactly on this CPU (measured: difference 0 for every
# kind; the tolerance only allows for another platform's batch-dependent kernels). bf16 keeps 8
# significant bits, so each cached state is off by up to 2^-9 relative; the loss moves far less
# (measured worst relative difference: medusa 6e-6, eagle 4e-5, eagle3 2e-5, mtp 1e-5).
TOLERANCE = {"float32": {"rtol": 1e-6, "atol": 0.0}, "bfloat16": {"rtol": 5e-4, "atol": 0.0}}


def _rows(count=10, seed=0):
    """Rows of different lengths (so batches pad), counting up by a per-row stride."""
    generator = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for row in range(count):
        length = int(torch.randint(12, 30, (), generator=generator))
        stride, start = 1 + row % 3, 3 + 7 * row
        ids.append([3 + (start + stride * j) % 60 for j in range(length)])
        masks.append([0] * 4 + [1] * (length - 4))
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "loss_mask": masks,
            "length": [len(r) for r in ids],
            "id": [str(i) for i in range(count)],
        }
    )


def _write_cache(directory, model, head, splits, dtype):
    identity = CacheIdentity.build(model, "tiny", None, head, splits, max_length=1024)
    write_feature_cache(model, splits, directory, identity, dtype=dtype, examples_per_shard=4, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(HEAD_CONFIGS))
def test_offline_loss_equals_online_loss_for_the_same_batch(tmp_path, tiny_llama, kind, dtype):
    splits = {"train": _rows(10), "validation": _rows(3, seed=1)}
    torch.manual_seed(0)
    head = build_head(tiny_llama, HEAD_CONFIGS[kind])
    head.init_from_data(supervised_token_counts(splits["train"], 256))
    head.eval()  # no EAGLE feature noise: both sides see the same inputs
    _write_cache(tmp_path, tiny_llama, head, splits, dtype)
    offline = open_feature_cache(str(tmp_path), tiny_llama, "tiny", None, head, splits, 1024, torch.float32)
    online = OnlineHiddenStates(tiny_llama)
    padded = 0
    for split, dataset in splits.items():
        for batch in fixed_batches(dataset, 4, 0, seed=0):
            padded += int(batch["attention_mask"].min() == 0)
            arguments = (batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
            argmax = offline.base_argmax(batch, split)
            assert argmax is not None and online.base_argmax(batch, split) is None
            with torch.no_grad():
                expected = compute_objective(head, online(batch, split), *arguments)
                actual = compute_objective(head, offline(batch, split), *arguments, base_argmax=argmax)
            torch.testing.assert_close(actual.loss, expected.loss, **TOLERANCE[dtype])
            if dtype == "float32":
                assert torch.equal(actual.top1_correct, expected.top1_correct)
    assert padded >= 2  # batches with padded rows are covered


def _config(tmp_path, kind, name, *overrides):
    return load_run_config(
        None,
        HEAD_OVERRIDES[kind]
        + [
            f"train.output_dir={tmp_path / name}",
            "train.max_steps=6",
            "train.micro_batch_size=4",
            "train.learning_rate=2e-2",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.eval_every=3",
            "train.save_every=0",
            "train.base_throughput_batches=0",
            *overrides,
        ],
    )


@pytest.mark.parametrize("kind", sorted(HEAD_OVERRIDES))
def test_offline_training_follows_online_training(tmp_path, tiny_llama, kind):
    splits = {"train": _rows(10), "validation": _rows(4, seed=1)}
    online = run_training(
        _config(tmp_path, kind, "online"), base_model=tiny_llama, datasets=tuple(splits.values())
    )
    head = build_head(tiny_llama, load_run_config(None, HEAD_OVERRIDES[kind]).head)
    _write_cache(tmp_path / "features", tiny_llama, head, splits, "float32")
    run = _config(tmp_path, kind, "offline", f"data.features={tmp_path / 'features'}")
    offline = run_training(run, base_model=tiny_llama, datasets=tuple(splits.values()))
    online_losses = [r["loss"] for r in read_metrics(tmp_path / "online") if "loss" in r]
    offline_losses = [r["loss"] for r in read_metrics(tmp_path / "offline") if "loss" in r]
    assert len(offline_losses) == 6
    assert offline_losses == pytest.approx(online_losses, rel=1e-4)
    assert offline.eval["top1"] == pytest.approx(online.eval["top1"], abs=1e-6)


def test_one_eagle3_cache_trains_a_medusa_head_as_its_own_cache_would(tmp_path, tiny_llama):
    splits = {"train": _rows(6), "validation": _rows(2, seed=1)}
    for kind in ("eagle3", "medusa"):
        _write_cache(
            tmp_path / kind, tiny_llama, build_head(tiny_llama, HEAD_CONFIGS[kind]), splits, "float32"
        )
    losses = {}
    for kind in ("eagle3", "medusa"):  # the cache's kind; the run trains Medusa from both
        run = _config(tmp_path, "medusa", f"from-{kind}", f"data.features={tmp_path / kind}")
        run_training(run, base_model=tiny_llama, datasets=tuple(splits.values()))
        losses[kind] = [r["loss"] for r in read_metrics(tmp_path / f"from-{kind}") if "loss" in r]
    assert len(losses["eagle3"]) == 6 and losses["eagle3"] == losses["medusa"]


def test_training_refuses_a_cache_without_the_heads_hidden_states(tmp_path, tiny_llama):
    splits = {"train": _rows(6), "validation": _rows(2, seed=1)}
    head = build_head(tiny_llama, HEAD_CONFIGS["medusa"])
    _write_cache(tmp_path / "features", tiny_llama, head, splits, "bfloat16")
    run = _config(tmp_path, "eagle3", "run", f"data.features={tmp_path / 'features'}")
    with pytest.raises(
        FeatureCacheError, match=r"lacks hidden states \[1, 2, 3\] that the eagle3 head reads"
    ):
        run_training(run, base_model=tiny_llama, datasets=tuple(splits.values()))


def test_training_refuses_a_cache_for_other_rows(tmp_path, tiny_llama):
    splits = {"train": _rows(6), "validation": _rows(2, seed=1)}
    head = build_head(tiny_llama, HEAD_CONFIGS["medusa"])
    _write_cache(tmp_path / "features", tiny_llama, head, splits, "bfloat16")
    run = _config(tmp_path, "medusa", "run", f"data.features={tmp_path / 'features'}")
    other = (_rows(6, seed=7), splits["validation"])
    with pytest.raises(FeatureCacheError, match="rows"):
        run_training(run, base_model=tiny_llama, datasets=other)
