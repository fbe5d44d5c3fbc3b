"""``draftheads train`` as 2 gloo processes (torchrun, 1 thread each) on a tiny Llama saved to disk.

What a run learns must not depend on how many processes ran it: 2 ranks x micro-batch 2 read the
batches, draw the sampled tokens and average the gradients that 1 rank x micro-batch 2 x
accumulation 2 does, so the final heads agree to float rounding (TOLERANCE) for every head kind
and ZeRO stage, with the shipped EAGLE-3 loss_token_fraction of 0.25. Two-rank checkpoints
resume with 2 ranks to the uninterrupted run's weights, and with 1 rank (and 1-rank checkpoints
with 2) through a universal conversion.

Each launch costs ~30 s of process start-up on a shared 2-core CPU; the smoke selection
(``-m "not integration"``) keeps EAGLE-3 under ZeRO-2 and ZeRO-3 and the ZeRO-3 resume, the rest
is marked integration and slow (``make test`` skips it).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from distributed_launch import (
    COLLECTIVE_TIMEOUT_SECONDS,
    DRAFTHEADS,
    ROOT,
    empty_config,
    head_weights,
    launch_environment,
    launch_parameter_dump,
    launch_train,
    launch_with_deepspeed,
    max_relative_difference,
    run_options,
    write_conversations,
    write_tiny_base,
)
from safetensors.torch import load_file

from draftheads.base_model import load_base
from draftheads.config import load_run_config
from draftheads.distributed import free_port
from draftheads.heads import load_head
from draftheads.train import checkpoint
from draftheads.train.decode_eval import CONTINUATIONS_NAME
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics
from draftheads.tuning.acceptance import measure_acceptance

# 2 ranks vs 1 rank x accumulation 2: the same sums in another order. Measured max relative
# weight difference after 6 steps: 0 (bit-identical) under ZeRO-0; ZeRO-2/3 reduce gradients in
# buckets, and Adam's m / sqrt(v) magnifies that rounding where an element's gradients are tiny.
# On an AVX2-only EPYC Zen 2, Medusa-2 under ZeRO-2 gives 1.3e-4: typical elements differ by
# ~1e-8, five of 4,096 in a zero-initialised Medusa residual layer (scale 0.027) by up to 3.4e-6.
# Sampling each process's loss tokens on its own (a real bug) gave 0.15, 1000x this bound.
TOLERANCE = 1e-3
LOSS_TOLERANCE = 1e-5  # the logged losses: rounding that no optimiser state has magnified
SMOKE = {("eagle3", 2), ("eagle3", 3)}
KINDS = ("medusa", "eagle", "eagle3", "mtp", "medusa2")


def _matrix():
    for kind in KINDS:
        for zero in (0, 2, 3):
            marks = () if (kind, zero) in SMOKE else (pytest.mark.integration, pytest.mark.slow)
            yield pytest.param(kind, zero, marks=marks, id=f"{kind}-zero{zero}")


@dataclass
class Workspace:
    root: Path
    base: Path
    conversations: Path
    config: Path
    launches: dict

    def options(self, output_dir: Path, kind: str, zero: int, *extra: str) -> list[str]:
        return run_options(self.base, self.conversations, output_dir, kind, zero, *extra)

    def two_ranks(self, kind: str, zero: int) -> Path:
        """The output directory of the 2-rank run (launched once per module)."""
        if (kind, zero) not in self.launches:
            output_dir = self.root / f"{kind}-zero{zero}-2ranks"
            result = launch_train(2, self.options(output_dir, kind, zero), self.config)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            self.launches[kind, zero] = output_dir
        return self.launches[kind, zero]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("distributed")
    conversations = write_conversations(root / "conversations.jsonl", varied_lengths=True)
    base = write_tiny_base(root / "base", conversations)
    return Workspace(root, base, conversations, empty_config(root), {})


def _losses(output_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(output_dir) if "loss" in record]


@pytest.mark.parametrize(("kind", "zero"), list(_matrix()))
def test_two_ranks_train_what_one_rank_trains_with_accumulation(workspace, kind, zero):
    two = workspace.two_ranks(kind, zero)
    one = workspace.root / f"{kind}-zero{zero}-1rank"
    run_training(
        load_run_config(
            workspace.config,
            workspace.options(one, kind, zero, "train.gradient_accumulation_steps=2"),
        )
    )
    difference = max_relative_difference(head_weights(two), head_weights(one))
    print(f"{kind} ZeRO-{zero}: max relative weight difference {difference:.3g}", file=sys.stderr)
    assert difference <= TOLERANCE, difference
    # Rank 0 alone writes metrics, curves and the head; the loss it logs is both ranks' mean.
    assert len(_losses(two)) == 6
    assert _losses(two) == pytest.approx(_losses(one), rel=LOSS_TOLERANCE)
    assert (two / "curves.png").stat().st_size > 0
    saved = json.loads((two / "head" / "config.json").read_text())
    assert saved["training"]["steps"] == 6
    assert (
        saved["training"]["tokens"]
        == json.loads((one / "head" / "config.json").read_text())["training"]["tokens"]
    )


@pytest.mark.parametrize(
    "zero",
    [pytest.param(zero, marks=[pytest.mark.integration, pytest.mark.slow]) for zero in (0, 2)] + [3],
)
def test_a_two_rank_checkpoint_resumes_with_two_ranks_to_the_same_weights(workspace, zero):
    whole = workspace.two_ranks("eagle3", zero)
    stopped = workspace.root / f"eagle3-zero{zero}-stopped"
    # A run that died after its step-3 checkpoint: that checkpoint is all its directory holds.
    shutil.copytree(whole / "checkpoints" / "step-00000003", stopped / "checkpoints" / "step-00000003")
    options = workspace.options(stopped, "eagle3", zero, "train.resume=true")
    result = launch_train(2, options, workspace.config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    expected, actual = head_weights(whole), head_weights(stopped)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    assert _losses(stopped) == _losses(whole)[3:]


def test_the_deepspeed_launcher_trains_what_torchrun_trains(workspace):
    """The launch line of the docs and config headers, ``deepspeed --num_gpus N $(which draftheads)
    train ...``: its ranks get ``--local_rank=N`` before the command and must train as torchrun's."""
    expected = workspace.two_ranks("eagle3", 2)
    output_dir = workspace.root / "eagle3-zero2-deepspeed-launcher"
    result = launch_with_deepspeed(2, workspace.options(output_dir, "eagle3", 2), workspace.config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "--local_rank=1" in result.stdout + result.stderr  # the launcher's argv, as it logs it
    actual = head_weights(output_dir)
    for name, tensor in head_weights(expected).items():
        assert torch.equal(actual[name], tensor), name
    assert _losses(output_dir) == _losses(expected)


def _elastic_params():
    for zero in (0, 2, 3):  # ZeRO-0 in fp32 is not partitioned: it loads without a conversion
        for direction in ("2to1", "1to2"):
            marks = () if zero == 3 else (pytest.mark.integration, pytest.mark.slow)
            yield pytest.param(zero, direction, marks=marks, id=f"zero{zero}-{direction}")


@pytest.mark.parametrize(("zero", "direction"), list(_elastic_params()))
def test_a_checkpoint_resumes_at_another_world_size_and_the_run_goes_on(workspace, zero, direction):
    """2 ranks x accumulation 1 and 1 rank x accumulation 2 read the same batches; a checkpoint of
    either resumes in the other (through DeepSpeed's universal checkpoint conversion) to the
    uninterrupted run's weights and losses."""
    one_rank = ["train.gradient_accumulation_steps=2"]
    if direction == "2to1":
        whole = workspace.two_ranks("eagle3", zero)
    else:
        whole = workspace.root / f"eagle3-zero{zero}-1rank-whole"
        run_training(load_run_config(workspace.config, workspace.options(whole, "eagle3", zero, *one_rank)))
    stopped = workspace.root / f"eagle3-zero{zero}-resumed-{direction}"
    shutil.copytree(whole / "checkpoints" / "step-00000003", stopped / "checkpoints" / "step-00000003")
    if direction == "2to1":
        options = workspace.options(stopped, "eagle3", zero, "train.resume=true", *one_rank)
        run_training(load_run_config(workspace.config, options))
    else:
        options = workspace.options(stopped, "eagle3", zero, "train.resume=true")
        result = launch_train(2, options, workspace.config)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    difference = max_relative_difference(head_weights(stopped), head_weights(whole))
    print(f"ZeRO-{zero} {direction}: max relative weight difference {difference:.3g}", file=sys.stderr)
    assert difference <= TOLERANCE, difference
    assert _losses(stopped) == pytest.approx(_losses(whole)[3:], rel=LOSS_TOLERANCE)
    leftovers = [
        path.name for path in (stopped / "checkpoints").iterdir() if not path.name.startswith("step-")
    ]
    assert leftovers == []  # the universal conversion is removed once loaded


@pytest.mark.integration
@pytest.mark.slow
def test_medusa2_adapter_gradients_are_averaged_across_ranks(workspace):
    """After training, both ranks hold the same adapter and heads, equal to one rank trained on
    the same global batch (were the adapter's gradients not averaged, each rank's adapter would
    follow its own batches)."""
    options = workspace.options(workspace.root / "medusa2-dump-2", "medusa2", 2)
    two = workspace.root / "medusa2-dump-2-ranks"
    two.mkdir()
    result = launch_parameter_dump(2, options, workspace.config, two)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    one = workspace.root / "medusa2-dump-1-rank"
    one.mkdir()
    options = workspace.options(
        workspace.root / "medusa2-dump-1", "medusa2", 2, "train.gradient_accumulation_steps=2"
    )
    result = launch_parameter_dump(1, options, workspace.config, one)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rank0, rank1, single = (
        torch.load(path / name) for path, name in [(two, "rank0.pt"), (two, "rank1.pt"), (one, "rank0.pt")]
    )
    adapter = [name for name in rank0 if "lora_" in name]
    assert adapter and any("head" in name for name in rank0)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert max_relative_difference(rank0, single) <= TOLERANCE
    # The adapter moved (the comparison is not of untouched weights).
    untrained_b = [name for name in adapter if "lora_B" in name]
    assert any(rank0[name].abs().max() > 0 for name in untrained_b)


HUNG_RANK_TIMEOUT_SECONDS = 20  # the collective timeout in the hung-rank case


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_makes_the_other_exit_with_an_error(workspace, how):
    """No launcher to clean up: two plain ``draftheads train`` processes joined by environment
    variables, and rank 1 killed (SIGKILL: its sockets close) or hung (SIGSTOP: they stay open)
    mid-run. Rank 0 must fail, at once or after the collective timeout, instead of waiting forever."""
    output_dir = workspace.root / f"rank-{how}"
    options = workspace.options(output_dir, "medusa", 0, "train.max_steps=100000", "train.save_every=0")
    environment = launch_environment()
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    timeout = COLLECTIVE_TIMEOUT_SECONDS
    if how == "hung":
        timeout = HUNG_RANK_TIMEOUT_SECONDS
        environment["DRAFTHEADS_DISTRIBUTED_TIMEOUT"] = str(timeout)
    command = [str(DRAFTHEADS), "train", "--config", str(workspace.config), *options]
    ranks = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        while not (output_dir / "metrics.jsonl").is_file() or not _losses(output_dir):
            assert time.monotonic() < deadline, "training never started"
            assert ranks[0].poll() is None and ranks[1].poll() is None, "a rank exited before training"
            time.sleep(0.5)
        ranks[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.monotonic()
        code = ranks[0].wait(timeout=timeout + 60)
        waited = time.monotonic() - stopped
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert code != 0
    print(f"rank 1 {how}: rank 0 exited {code} after {waited:.1f} s", file=sys.stderr)


def test_two_ranks_write_one_head_and_one_set_of_checkpoints(workspace):
    """The 2-rank head is an ordinary saved head (rank 0 wrote it once, not once per rank)."""
    two = workspace.two_ranks("eagle3", 2)
    files = sorted(path.name for path in (two / "head").iterdir())
    assert "model.safetensors" in files and "config.json" in files
    assert load_file(str(two / "head" / "model.safetensors"))
    assert [path.name for path in checkpoint.list_checkpoints(two)] == ["step-00000003", "step-00000006"]


@pytest.mark.integration
@pytest.mark.slow
def test_two_ranks_take_the_decode_eval_in_step_under_zero3(workspace):
    """Rank 0 generates the continuations and sends them; both ranks measure the same head on
    them (under ZeRO-3 each module gathers its parameters as it runs, the same calls on both), so
    neither waits on the other; rank 0 records what ``measure_acceptance`` gives on the head."""
    prompts = workspace.root / "decode-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "turns": [f"Count from {i}."]}) + "\n" for i in range(3)))
    output_dir = workspace.root / "decode-eval-2ranks"
    options = workspace.options(
        output_dir,
        "eagle3",
        3,
        "train.decode_eval_prompts=2",
        f"train.decode_eval_source={prompts}",
        "train.decode_eval_max_new_tokens=8",
        "train.decode_eval_depth=2",
    )
    result = launch_train(2, options, workspace.config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    evaluations = [record["eval"] for record in read_metrics(output_dir) if "eval" in record]
    assert len(evaluations) == 2 and all(len(e["decode"]["top1"]) == 2 for e in evaluations)
    model, _ = load_base(str(workspace.base), dtype="float32")
    head = load_head(output_dir / "head", model).eval()
    record = json.loads((output_dir / CONTINUATIONS_NAME).read_text())
    sequences = [(torch.tensor(s["tokens"]), s["prompt_length"]) for s in record["sequences"]]
    direct = measure_acceptance(model, head, sequences, 2, top_k=1, progress=False)
    assert evaluations[-1]["decode"]["top1"] == [row[0] for row in direct.probabilities]
    assert evaluations[-1]["decode"]["counted"] == list(direct.counts)
