"""``draftheads plan``: exact parameter counts from meta modules, the ZeRO arithmetic, offline
runs without the base's layers, the largest micro-batch, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftheads.cli import main
from draftheads.config import load_run_config
from draftheads.plan import cache_bytes_per_token, count_shapes, largest_micro_batch, plan_step

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CONFIG = ROOT / "configs" / "llama3-8b_eagle3_8gpu.yaml"
LLAMA_SHAPE = ROOT / "configs" / "bases" / "llama3-8b.json"


@pytest.fixture(scope="module")
def llama_shapes():
    from draftheads.commands.plan import base_config_of

    run = load_run_config(LLAMA_CONFIG)
    return count_shapes(run, base_config_of(run, LLAMA_SHAPE))


def terms(plan) -> dict[str, float]:
    return {term.name: term.bytes for term in plan.terms}


def test_parameter_counts_are_the_real_models(llama_shapes):
    assert llama_shapes.base_parameters == 8_030_261_248  # Llama-3.1-8B
    assert llama_shapes.skeleton_parameters == 2 * 128_256 * 4_096 + 4_096  # embeddings, lm_head, norm
    assert round(llama_shapes.head_parameters / 1e6, 1) == 424.7  # EAGLE-3, 32k draft vocabulary
    assert cache_bytes_per_token(llama_shapes) == 4 * 4_096 * 2 + 8


def test_zero_stages_divide_what_they_partition(llama_shapes):
    run = load_run_config(LLAMA_CONFIG)
    zero2 = terms(plan_step(run, llama_shapes, gpus=8))
    zero3 = terms(
        plan_step(
            load_run_config(LLAMA_CONFIG, ["train.deepspeed_config=configs/deepspeed/zero3.json"]),
            llama_shapes,
            gpus=8,
        )
    )
    parameters = llama_shapes.head_parameters
    assert zero2["head weights"] == parameters * 2
    assert zero3["head weights"] == parameters * 2 / 8
    assert zero2["optimizer"] == pytest.approx(12 * parameters / 8)
    assert zero2["frozen base"] == llama_shapes.base_parameters * 2


def test_an_offline_plan_holds_no_decoder_layer(llama_shapes):
    offline = load_run_config(LLAMA_CONFIG, ["data.features=/somewhere"])
    planned = terms(plan_step(offline, llama_shapes, gpus=8))
    assert planned["frozen base"] == llama_shapes.skeleton_parameters * 2
    assert planned["base forward"] == 2048 * 4 * 4096 * 2  # the four cached states of a row


def test_gradient_checkpointing_keeps_each_pass_input_and_recomputes_one(llama_shapes):
    kept = terms(plan_step(load_run_config(LLAMA_CONFIG), llama_shapes, gpus=8))
    recomputed = terms(
        plan_step(load_run_config(LLAMA_CONFIG, ["train.gradient_checkpointing=true"]), llama_shapes, gpus=8)
    )
    rows, h, kv = 2048, 4096, 1024  # the config's micro-batch of 1 x 2,048, Llama-3.1-8B's widths
    per_pass = kept["head activations"] / 7  # 7 TTT steps
    assert recomputed["head activations"] == pytest.approx(7 * rows * (h + 2 * kv) * 2 + per_pass)
    assert {name: value for name, value in recomputed.items() if name != "head activations"} == {
        name: value for name, value in kept.items() if name != "head activations"
    }


def test_the_largest_micro_batch_is_the_last_that_fits(llama_shapes):
    run = load_run_config(LLAMA_CONFIG)
    three = plan_step(run, llama_shapes, gpus=8, batch=3).total
    assert largest_micro_batch(run, llama_shapes, 8, three) == 3
    assert largest_micro_batch(run, llama_shapes, 8, three - 1) == 2
    assert largest_micro_batch(run, llama_shapes, 8, 1.0) == 0


def test_the_command_prints_every_term_and_the_verdict(capsys):
    assert (
        main(["plan", "--config", str(LLAMA_CONFIG), "--base-config", str(LLAMA_SHAPE), "--gpu-memory", "80"])
        == 0
    )
    out = capsys.readouterr().out
    for name in ("frozen base", "head weights", "gradients", "optimizer", "attention", "loss", "peak"):
        assert name in out
    assert "largest micro-batch that fits" in out and "32,776 bytes a token" in out


def test_a_base_config_without_a_model_type_is_one_line(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 4096}')
    assert main(["plan", "--config", str(LLAMA_CONFIG), "--base-config", str(bad)]) == 3
    assert f"--base-config {bad}: no model_type field" in capsys.readouterr().err


def test_zero_buckets_are_fitted_to_the_trainable_parameters():
    from draftheads.train.engine import with_buckets_fitted

    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000_000, "overlap_comm": True}}
    fitted = with_buckets_fitted(config, 424_700_000)
    assert fitted["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 424_700_000,
        "overlap_comm": True,
    }
    assert with_buckets_fitted(config, 10**9)["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert with_buckets_fitted({"zero_optimization": {"stage": 0}}, 5) == {"zero_optimization": {"stage": 0}}
    assert config["zero_optimization"]["reduce_bucket_size"] == 500_000_000  # the given config is left alone
