"""Host syncs of a training step, counted on the CPU (draftheads.train.host_syncs): each one
would stall a GPU. The loop adds one per optimizer step (the non-finite loss check across ranks)
and reads metrics only when it logs; the objectives' value-dependent gathers (they project only
the supervised rows onto the vocabulary) cost the counts in OBJECTIVE_SYNCS, which must not grow."""

from __future__ import annotations

import pytest
import torch

from draftheads.config import load_run_config
from draftheads.train import loop
from draftheads.train.host_syncs import HostSyncCounter
from draftheads.train.setup import setup
from tests.train.tiny_runs import HEAD_OVERRIDES, patterned_dataset

# Per micro-batch, forward and backward with online hidden states, measured on the tiny Llama (one
# of each is transformers' masking_utils checking whether a padding mask can be skipped); the rest
# are the objectives' nonzero / boolean-index gathers of supervised rows, and for EAGLE-3 its
# per-step widths of the unrolled rows.
OBJECTIVE_SYNCS = {"medusa": 6, "eagle": 4, "eagle3": 7, "mtp": 6}
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


def _syncs_of_a_run(tmp_path, kind: str, steps: int) -> int:
    config = load_run_config(
        None,
        HEAD_OVERRIDES[kind]
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
    run = setup(config, base_model=make_tiny_llama(), datasets=(dataset, dataset))
    try:
        with HostSyncCounter() as syncs:
            loop.train_steps(run)
    finally:
        loop.cleanup(run)
    return syncs.total


@pytest.mark.parametrize("kind", sorted(OBJECTIVE_SYNCS))
def test_host_syncs_per_step_do_not_grow(tmp_path, kind):
    """Two runs that differ by 2 optimizer steps (4 micro-batches) differ by exactly their syncs."""
    per_two_steps = _syncs_of_a_run(tmp_path, kind, 4) - _syncs_of_a_run(tmp_path, kind, 2)
    per_step = per_two_steps / 2
    expected = 2 * OBJECTIVE_SYNCS[kind] + LOOP_SYNCS_PER_STEP  # accumulation 2
    print(f"{kind}: {per_step:g} host syncs per optimizer step of 2 micro-batches")
    assert per_step <= expected, per_step
