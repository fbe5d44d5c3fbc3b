"""The real training loop (DeepSpeed on CPU, one gloo process) on a tiny random Llama."""

import dataclasses
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from draftheads.config import load_run_config
from draftheads.heads import load_head
from draftheads.settings import ConfigError
from draftheads.train import checkpoint
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics
from tests.train.tiny_runs import HEAD_OVERRIDES, patterned_dataset


def _config(tmp_path, kind, *overrides):
    return load_run_config(
        None,
        HEAD_OVERRIDES[kind]
        + [
            f"train.output_dir={tmp_path / kind}",
            "train.max_steps=30",
            "train.micro_batch_size=4",
            "train.learning_rate=2e-2",
            "train.warmup_steps=2",
            "train.log_every=1",
            "train.eval_every=15",
            "train.save_every=15",
            "train.base_throughput_batches=2",
            *overrides,
        ],
    )


@pytest.fixture
def confident_llama(tiny_llama):
    """The tiny Llama with a sharpened lm_head: a random model's next-token distribution is almost
    uniform, which puts the floor of soft-target losses (EAGLE, EAGLE-3) near ln(V) and hides
    learning; peaked targets make every head's loss able to fall far."""
    with torch.no_grad():
        tiny_llama.lm_head.weight.mul_(20.0)
    return tiny_llama


@pytest.mark.parametrize("kind", sorted(HEAD_OVERRIDES))
def test_overfitting_a_fixed_dataset_lowers_the_loss(tmp_path, confident_llama, kind):
    tiny_llama = confident_llama
    dataset = patterned_dataset()
    summary = run_training(_config(tmp_path, kind), base_model=tiny_llama, datasets=(dataset, dataset))
    records = read_metrics(tmp_path / kind)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses
    first_accuracy = sum(r["top1"][0] for r in records[:3]) / 3
    assert summary.eval["top1"][0] > max(0.1, first_accuracy + 0.05), (first_accuracy, summary.eval)
    assert summary.steps == 30 and summary.tokens == 30 * 4 * 24
    assert summary.base_forward_tokens_per_second > 0
    # The exported head loads without DeepSpeed and carries the training summary.
    head = load_head(tmp_path / kind / "head", tiny_llama)
    assert head.kind == kind
    saved = json.loads((tmp_path / kind / "head" / "config.json").read_text())
    assert saved["training"]["steps"] == 30
    assert (tmp_path / kind / "curves.png").stat().st_size > 0
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / kind)] == [
        "step-00000015",
        "step-00000030",
    ]


@pytest.mark.parametrize("objective", ["log_acceptance", "kl_acceptance"])
def test_eagle3_acceptance_objectives_learn_the_base(tmp_path, confident_llama, objective, monkeypatch):
    """Trained on the acceptance rate instead of the cross-entropy (and only on it: the step loss
    the run calls is the objective's), the head still learns to agree with the base: its held-out
    top-1 rises well above the untrained head's."""
    from draftheads.train import losses

    calls = {name: 0 for name in losses.EAGLE3_STEP_LOSSES}
    for name, loss in list(losses.EAGLE3_STEP_LOSSES.items()):

        def counted(*args, name=name, terms=loss.terms, **kwargs):
            calls[name] += 1
            return terms(*args, **kwargs)

        monkeypatch.setitem(losses.EAGLE3_STEP_LOSSES, name, dataclasses.replace(loss, terms=counted))
    dataset = patterned_dataset()
    config = _config(tmp_path, "eagle3", f"head.objective={objective}")
    summary = run_training(config, base_model=confident_llama, datasets=(dataset, dataset))
    records = read_metrics(tmp_path / "eagle3")
    first_accuracy = sum(r["top1"][0] for r in records[:3] if "top1" in r) / 3
    assert summary.eval["top1"][0] > max(0.1, first_accuracy + 0.05), (first_accuracy, summary.eval)
    assert calls[objective] > 0 and sum(calls.values()) == calls[objective], calls
    saved = json.loads((tmp_path / "eagle3" / "head" / "config.json").read_text())
    assert saved["head_config"]["objective"] == objective


@pytest.mark.parametrize("kind", ["eagle", "medusa"])  # eagle draws feature noise: RNG must resume too
def test_a_resumed_run_ends_with_the_same_weights(tmp_path, tiny_llama, kind):
    dataset = patterned_dataset()
    options = [
        "train.max_steps=8",
        "train.save_every=4",
        "train.eval_every=4",
        "train.gradient_accumulation_steps=2",
        "train.micro_batch_size=2",
        "train.base_throughput_batches=0",
    ]
    whole = _config(tmp_path / "whole", kind, *options)
    run_training(whole, base_model=tiny_llama, datasets=(dataset, dataset))
    # A run that stopped after step 4: only the step-4 checkpoint survives in its output dir.
    stopped = tmp_path / "stopped" / kind
    (stopped / "checkpoints").mkdir(parents=True)
    (tmp_path / "whole" / kind / "checkpoints" / "step-00000004").rename(
        stopped / "checkpoints" / "step-00000004"
    )
    resumed = _config(tmp_path / "stopped", kind, *options, "train.resume=true")
    summary = run_training(resumed, base_model=tiny_llama, datasets=(dataset, dataset))
    assert summary.steps == 8
    expected = load_file(str(tmp_path / "whole" / kind / "head" / "model.safetensors"))
    actual = load_file(str(stopped / "head" / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    whole_records = [r for r in read_metrics(tmp_path / "whole" / kind) if "loss" in r]
    resumed_records = [r for r in read_metrics(stopped) if "loss" in r]
    assert [r["loss"] for r in resumed_records] == pytest.approx([r["loss"] for r in whole_records[4:]])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.micro_batch_size=0"], "train.micro_batch_size must be >= 1"),
        (["train.deepspeed_config=configs/deepspeed/nope.json"], "nope.json"),
        (["train.precision=fp16"], "train.precision must be one of"),
        (["train.report_to=tensorboard"], "train.report_to"),
        (["model.dtype=bfloat16", "train.precision=fp32"], "disagrees with model.dtype"),
        (["train.autocast=fp16"], "train.autocast must be one of"),
        (["train.precision=bf16", "train.autocast=bf16"], "train.autocast 'bf16' runs a fp32 head"),
    ],
)
def test_config_errors_name_the_field(tmp_path, tiny_llama, overrides, message):
    dataset = patterned_dataset(4)
    with pytest.raises(ConfigError, match=message):
        run_training(
            _config(tmp_path, "medusa", *overrides), base_model=tiny_llama, datasets=(dataset, dataset)
        )


def test_eagle3_layer_beyond_the_base_depth_is_a_config_error(tmp_path, tiny_llama):
    dataset = patterned_dataset(4)
    run = _config(tmp_path, "eagle3", "head.feature_layers=[1,2,9]")
    with pytest.raises(ConfigError, match="feature_layers"):
        run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))


def test_deepspeed_json_may_not_own_train_fields(tmp_path, tiny_llama):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0}))
    dataset = patterned_dataset(4)
    with pytest.raises(ConfigError, match="'gradient_clipping' is set from train.grad_clip"):
        run_training(
            _config(tmp_path, "medusa", f"train.deepspeed_config={path}"),
            base_model=tiny_llama,
            datasets=(dataset, dataset),
        )


def test_existing_checkpoints_need_resume(tmp_path, tiny_llama):
    dataset = patterned_dataset(4)
    run = _config(tmp_path, "medusa", "train.max_steps=2", "train.save_every=0", "train.eval_every=0")
    run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))
    with pytest.raises(ConfigError, match="already holds checkpoints; set train.resume=true"):
        run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))


def test_training_time_counts_every_step_and_no_evaluation(tmp_path, tiny_llama, monkeypatch):
    """Each step costs 1 s and each evaluation or checkpoint 100 s on a simulated clock; with
    evaluations between logs (eval_every=3, log_every=2) every step's second still counts and no
    pause does, in the run's training time and in each logged window's tokens/s."""
    from types import SimpleNamespace

    from draftheads.train import loop

    clock = {"offset": 0.0}
    simulated = SimpleNamespace(perf_counter=lambda: time.perf_counter() + clock["offset"])
    monkeypatch.setattr(loop, "time", simulated)
    real_tokens, real_evaluate, real_save = loop.batch_tokens, loop._evaluate, loop.save

    def advancing(advance, function):
        def call(*args, **kwargs):
            clock["offset"] += advance
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(loop, "batch_tokens", advancing(1.0, real_tokens))  # once per step here
    monkeypatch.setattr(loop, "_evaluate", advancing(100.0, real_evaluate))
    monkeypatch.setattr(loop, "save", advancing(100.0, real_save))
    dataset = patterned_dataset()
    options = ["train.max_steps=6", "train.eval_every=3", "train.save_every=3", "train.log_every=2"]
    run = _config(tmp_path, "medusa", *options, "train.base_throughput_batches=0")
    summary = run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))
    assert 6.0 <= summary.train_seconds < 50.0, summary.train_seconds
    windows = [r for r in read_metrics(tmp_path / "medusa") if "loss" in r]
    assert [r["step"] for r in windows] == [2, 4, 6]
    for window in windows:  # 2 steps of 4 rows of 24 tokens, in at least 2 simulated seconds
        assert window["tokens_per_second"] <= 2 * 4 * 24 / 2.0, window


def test_wandb_offline_and_zero2(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dataset = patterned_dataset(4)
    run = _config(
        tmp_path,
        "medusa",
        "train.max_steps=3",
        "train.report_to=wandb",
        "train.deepspeed_config=configs/deepspeed/zero2.json",
    )
    summary = run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))
    assert summary.steps == 3
    assert list((tmp_path / "medusa" / "wandb").glob("offline-run-*"))


def test_bf16_training_on_cpu(tmp_path, tiny_llama):
    base = tiny_llama.to(torch.bfloat16)
    dataset = patterned_dataset()
    run = _config(
        tmp_path,
        "medusa",
        "train.precision=bf16",
        "train.max_steps=10",
        "train.base_throughput_batches=0",
        "train.deepspeed_config=configs/deepspeed/zero2.json",
    )
    run_training(run, base_model=base, datasets=(dataset, dataset))
    losses = [r["loss"] for r in read_metrics(tmp_path / "medusa") if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert load_head(tmp_path / "medusa" / "head", base).heads[0].lm_head.weight.dtype == torch.bfloat16


def test_bf16_autocast_trains_a_fp32_head(tmp_path, confident_llama):
    """train.autocast=bf16 keeps fp32 weights (saved as fp32) and still learns."""
    dataset = patterned_dataset()
    run = _config(tmp_path, "eagle3", "train.autocast=bf16", "train.base_throughput_batches=0")
    run_training(run, base_model=confident_llama, datasets=(dataset, dataset))
    losses = [r["loss"] for r in read_metrics(tmp_path / "eagle3") if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses
    head = load_head(tmp_path / "eagle3" / "head", confident_llama)
    assert {p.dtype for p in head.parameters()} == {torch.float32}


def test_joint_heads_refuse_autocast(tmp_path, tiny_llama):
    dataset = patterned_dataset(4)
    run = _config(tmp_path, "medusa", "head.joint=true", "train.autocast=bf16")
    with pytest.raises(ConfigError, match="train.autocast=bf16: not supported for joint"):
        run_training(run, base_model=tiny_llama, datasets=(dataset, dataset))


def test_init_head_continues_from_a_saved_head_and_refuses_a_different_one(tmp_path, confident_llama):
    """train.init_head starts from a finished run's head (weights and EAGLE-3's vocabulary maps):
    its first evaluation already scores what the saved head scored; other settings are refused."""
    dataset = patterned_dataset()
    first = run_training(_config(tmp_path, "eagle3"), base_model=confident_llama, datasets=(dataset, dataset))
    saved_dir = tmp_path / "eagle3" / "head"
    saved = load_head(saved_dir)
    overrides = [
        f"train.init_head={saved_dir}",
        f"train.output_dir={tmp_path / 'continued'}",
        "train.max_steps=0",
    ]

    def continue_saved(*settings: str, kind: str = "eagle3"):
        """The saved head scored without a step (train.max_steps=0), with ``settings`` on top."""
        return run_training(
            _config(tmp_path, kind, *overrides, *settings),
            base_model=confident_llama,
            datasets=(dataset, dataset),
        )

    continued = continue_saved()
    assert continued.steps == 0 and continued.tokens == 0
    rescored = load_head(tmp_path / "continued" / "head")
    assert torch.equal(rescored.t2d, saved.t2d)
    rescored_weights = rescored.state_dict()
    for name, weight in saved.state_dict().items():
        assert torch.equal(rescored_weights[name], weight), name  # scored and exported as it was
    assert continued.eval["top1"] == pytest.approx(first.eval["top1"], abs=1e-6)
    # A setting that only chose the first weights need not match: the saved weights replace them.
    from_base = continue_saved("head.init_from_base=true", f"train.output_dir={tmp_path / 'b'}")
    assert from_base.eval["top1"] == pytest.approx(first.eval["top1"], abs=1e-6)
    # Nor one that only shapes the loss, or how many steps training unrolls (the first step's score
    # is the saved head's; the run reports one more step).
    hard = continue_saved("head.hard_target_weight=1.0", f"train.output_dir={tmp_path / 'h'}")
    assert hard.eval["top1"] == pytest.approx(first.eval["top1"], abs=1e-6)
    deeper = continue_saved("head.ttt_steps=3", f"train.output_dir={tmp_path / 'd'}")
    assert len(deeper.eval["top1"]) == len(first.eval["top1"]) + 1
    assert deeper.eval["top1"][: len(first.eval["top1"])] == pytest.approx(first.eval["top1"], abs=1e-6)

    # A wider draft MLP grows from the saved head and starts where it left off; a narrower one is refused.
    grown = continue_saved("head.intermediate_size=192", f"train.output_dir={tmp_path / 'g'}")
    assert grown.eval["top1"] == pytest.approx(first.eval["top1"], abs=1e-6)
    assert load_head(tmp_path / "g" / "head").midlayer.mlp.up_proj.weight.shape[0] == 192
    with pytest.raises(ConfigError, match=r"draft MLP is 128 wide.*head.intermediate_size is 64"):
        continue_saved("head.intermediate_size=64", f"train.output_dir={tmp_path / 's'}")
    # More draft layers grow from the saved head too (the new ones start as the identity).
    deeper_head = continue_saved("head.num_layers=2", f"train.output_dir={tmp_path / 'l'}")
    assert deeper_head.eval["top1"] == pytest.approx(first.eval["top1"], abs=1e-6)
    assert len(load_head(tmp_path / "l" / "head").layers) == 1
    # A larger draft vocabulary keeps the saved ids and adds this run's most frequent others; the
    # patterned rows use ids 3-62, so the saved 64 ids already cover every target and top-1 moves
    # only where an added id's fitted row outscores the right one.
    wider_vocab = continue_saved("head.draft_vocab_size=80", f"train.output_dir={tmp_path / 'v'}")
    grown_vocab = load_head(tmp_path / "v" / "head")
    assert grown_vocab.draft_vocab_size == 80
    assert torch.all(grown_vocab.t2d[saved.t2d])
    assert wider_vocab.eval["top1"][0] == pytest.approx(first.eval["top1"][0], abs=0.05)
    with pytest.raises(ConfigError, match=r"has 64 ids, this run's head.draft_vocab_size is 32"):
        continue_saved("head.draft_vocab_size=32", f"train.output_dir={tmp_path / 'w'}")
    with pytest.raises(ConfigError, match=r"head.feature_layers is \(1, 2, 3\), this run's is \(1, 2, 4\)"):
        continue_saved("head.feature_layers=[1,2,4]", f"train.output_dir={tmp_path / 'x'}")
    with pytest.raises(ConfigError, match=r"a 'eagle3' head, but head.kind is 'medusa'"):
        continue_saved(f"train.output_dir={tmp_path / 'y'}", kind="medusa")
