"""Host syncs of a training step, counted on the CPU (draftheads.train.host_syncs): each one
would stall a GPU. The loop adds one per optimizer step (the non-finite loss check across ranks)
and reads metrics only when it logs; the objectives read nothing (what they score is laid out on
the host: draftheads.train.supervision). transformers' own mask preparation reads one value per
forward of the frozen base (``BASE_FORWARD_SYNCS``; none under torch.compile), outside our code."""

from __future__ import annotations

import pytest
import torch

from draftheads.config import load_run_config
from draftheads.train import loop
from draftheads.train.host_syncs import HOST_CODE, HostSyncCounter
from draftheads.train.setup import setup
from tests.train.tiny_runs import HEAD_OVERRIDES, patterned_dataset

RUN_OVERRIDES = {
    **HEAD_OVERRIDES,
    "dflash": ["head.kind=dflash", "head.feature_layers=[1,2,3]", "head.block_size=4", "head.num_layers=1"],
}
KINDS = tuple(sorted(RUN_OVERRIDES))
# Per micro-batch with online hidden states: transformers 5's masking_utils checks the position ids
# for packed sequences (find_packed_sequence_indices) when no padding mask is passed, as online
# training passes none (OnlineHiddenStates); with one, it checks the mask instead.
BASE_FORWARD_SYNCS = 1
TRANSFORMERS_MASKS = "transformers.masking_utils"
LOOP_SYNCS_PER_STEP = 1


def test_the_counter_sees_each_kind_of_sync():
    values = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncCounter() as syncs:
        values.sum().item()
        values.tolist()
        bool(values.any())
        values[values > 0]
        values.nonzero()
        torch.where(values > 0)
        values * 2  # no sync
        torch.where(values > 0, values, 0.0)  # no sync: three arguments
    assert dict(syncs.kinds) == {"item": 1, "tolist": 1, "bool": 1, "bool-index": 1, "nonzero": 2}


def _syncs_of_a_run(tmp_path, kind: str, steps: int, *overrides: str) -> tuple[int, int]:
    """(every sync, the syncs outside transformers' mask preparation) of a run of ``steps``."""
    config = load_run_config(
        None,
        [*RUN_OVERRIDES[kind], *overrides]
        + [
            f"train.output_dir={tmp_path / f'{kind}-{steps}'}",
            f"train.max_steps={steps}",
            "train.micro_batch_size=4",
            "train.gradient_accumulation_steps=2",
            "train.warmup_steps=1",
            "train.log_every=1000",  # one log record, at the last step, in both runs
            "train.eval_every=0",
            "train.save_every=0",
            "train.base_throughput_batches=0",
        ],
    )
    from tests.conftest import make_tiny_llama

    dataset = patterned_dataset(rows=32)
    base = make_tiny_llama()
    if config.data.features and not (tmp_path / "features").exists():
        write_cache(tmp_path / "features", base, config, {"train": dataset, "validation": dataset})
    run = setup(config, base_model=base, datasets=(dataset, dataset))
    try:
        with HostSyncCounter() as syncs, HostSyncCounter(HOST_CODE + (TRANSFORMERS_MASKS,)) as ours:
            loop.train_steps(run)
    finally:
        loop.cleanup(run)
    return syncs.total, ours.total


@pytest.mark.parametrize("kind", KINDS)
def test_at_most_one_host_sync_per_optimizer_step(tmp_path, kind):
    """Two runs that differ by 2 optimizer steps (4 micro-batches) differ by exactly their syncs."""
    longer, shorter = _syncs_of_a_run(tmp_path, kind, 4), _syncs_of_a_run(tmp_path, kind, 2)
    every, ours = ((a - b) / 2 for a, b in zip(longer, shorter, strict=True))
    print(f"{kind}: {every:g} host syncs per optimizer step of 2 micro-batches, {ours:g} in our code")
    assert ours <= LOOP_SYNCS_PER_STEP, ours
    assert every <= LOOP_SYNCS_PER_STEP + 2 * BASE_FORWARD_SYNCS, every  # accumulation 2


def write_cache(directory, base, config, splits) -> None:
    from draftheads.data.feature_identity import CacheIdentity
    from draftheads.data.features import write_feature_cache
    from draftheads.heads import build_head

    head = build_head(base, config.head)
    identity = CacheIdentity.build(
        base, config.model.base, None, head, splits, max_length=config.data.max_length
    )
    write_feature_cache(
        base, splits, directory, identity, dtype="bfloat16", examples_per_shard=8, progress=False
    )


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_cached_run_reads_its_rows_on_the_host(tmp_path, kind):
    """From a feature cache no base runs: the rows are read on the host before the batch moves, and
    nothing reads the device but the loop's one check per optimizer step."""
    features = f"data.features={tmp_path / 'features'}"
    longer, shorter = (
        _syncs_of_a_run(tmp_path, kind, 4, features),
        _syncs_of_a_run(tmp_path, kind, 2, features),
    )
    every = (longer[0] - shorter[0]) / 2
    print(f"{kind}, cached: {every:g} host syncs per optimizer step of 2 micro-batches")
    assert every <= LOOP_SYNCS_PER_STEP, every
