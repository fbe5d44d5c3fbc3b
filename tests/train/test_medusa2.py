"""Medusa-2: heads + a LoRA adapter on the base, trained together through the DeepSpeed loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from draftheads.config import JointConfig, load_run_config
from draftheads.heads import HeadMismatchError, MedusaConfig, build_head, load_head, load_head_and_base
from draftheads.heads.adapter import MERGED_ADAPTER_KEY
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.packed import has_packed_linears, packing_supported
from draftheads.settings import ConfigError
from draftheads.train.joint import JointRecipe, add_lora_adapter, head_loss_weight
from draftheads.train.loop import run_training
from draftheads.train.reporting import read_metrics
from tests.conftest import make_tiny_llama
from tests.train.tiny_runs import patterned_dataset


def _config(output_dir, *overrides):
    return load_run_config(
        None,
        [
            "head.kind=medusa",
            "head.num_heads=2",
            "head.joint=true",
            "joint.lora_rank=4",
            "joint.lora_alpha=8",
            f"train.output_dir={output_dir}",
            "train.max_steps=20",
            "train.micro_batch_size=4",
            "train.learning_rate=2e-2",
            "train.warmup_steps=2",
            "train.log_every=1",
            "train.eval_every=10",
            "train.save_every=10",
            "train.base_throughput_batches=0",
            *overrides,
        ],
    )


@torch.no_grad()
def _logits(model, input_ids):
    return model(input_ids).logits


def _trained_lm_run(tmp_path):
    dataset = patterned_dataset()
    run = _config(
        tmp_path / "run", "joint.base_loss=lm", "joint.lambda0=0.2", "joint.lambda0_warmup_ratio=0.5"
    )
    summary = run_training(run, base_model=make_tiny_llama(), datasets=(dataset, dataset))
    return summary, tmp_path / "run"


def test_joint_training_lowers_the_loss_and_saves_heads_with_the_adapter(tmp_path):
    summary, output_dir = _trained_lm_run(tmp_path)
    records = [r for r in read_metrics(output_dir) if "loss" in r]
    assert len(records) == 20
    weights = [r["head_loss_weight"] for r in records]
    assert (
        weights[0] == 0.0 and weights[5] == pytest.approx(0.2 * math.sin(math.pi / 4)) and weights[-1] == 0.2
    )
    # loss = base loss + lambda0 * head loss; lambda0 ramps up, so each part is checked on its own.
    base_losses = [r["base_loss"] for r in records]
    head_losses = [(r["loss"] - r["base_loss"]) / r["head_loss_weight"] for r in records[1:]]
    assert sum(base_losses[-3:]) / 3 < sum(base_losses[:3]) / 3 - 0.15, base_losses  # the adapter learns
    assert sum(head_losses[-3:]) / 3 < 0.4 * sum(head_losses[:3]) / 3, head_losses
    head_dir = output_dir / "head"
    assert json.loads((head_dir / "config.json").read_text())["head_config"]["joint"] is True
    adapter = load_file(str(head_dir / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in adapter.items())
    assert json.loads((head_dir / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert summary.eval["top1"][0] > 0.1


def test_loading_merges_the_adapter_into_a_copy_and_greedy_decoding_follows_it(tmp_path):
    _, output_dir = _trained_lm_run(tmp_path)
    head_dir = output_dir / "head"
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    original = _logits(make_tiny_llama(), prompt)
    reference = PeftModel.from_pretrained(make_tiny_llama(), str(head_dir / "adapter")).eval()
    adapted = _logits(reference, prompt)
    assert not torch.allclose(adapted, original, atol=1e-3)  # the adapter learned something

    base = make_tiny_llama()
    head, adapted_model = load_head_and_base(head_dir, base)
    assert head.config.joint and getattr(adapted_model.config, MERGED_ADAPTER_KEY)
    torch.testing.assert_close(_logits(adapted_model, prompt), adapted, rtol=1e-5, atol=1e-5)
    # the caller's base is unchanged
    assert getattr(base.config, MERGED_ADAPTER_KEY, None) is None
    torch.testing.assert_close(_logits(base, prompt), original)

    generator = SpeculativeGenerator(adapted_model, head, tree="cpu-8")
    generator_prompts = [prompt, torch.tensor([[40, 41, 42, 43, 44, 45, 46]]), torch.tensor([[7, 30, 3]])]
    for index, tokens in enumerate(generator_prompts):
        expected = adapted_model.generate(tokens, max_new_tokens=40, do_sample=False)
        result = generator.generate(tokens, max_new_tokens=40)
        assert result.sequences.tolist() == expected.tolist(), f"prompt {index}"


def test_a_base_with_another_merged_adapter_is_refused(tmp_path):
    _, output_dir = _trained_lm_run(tmp_path)
    base = make_tiny_llama()
    setattr(base.config, MERGED_ADAPTER_KEY, "0123456789abcdef")
    with pytest.raises(HeadMismatchError, match="already has adapter 0123456789abcdef merged"):
        load_head_and_base(output_dir / "head", base)
    with pytest.raises(HeadMismatchError):  # a joint head does not attach to a base without its adapter
        load_head(output_dir / "head", make_tiny_llama())


def test_the_adapter_disabled_teacher_is_the_original_base():
    prompt = torch.tensor([[5, 9, 13, 17, 21, 25]])
    original = _logits(make_tiny_llama(), prompt)
    base = make_tiny_llama()
    head = build_head(base, MedusaConfig(num_heads=2, joint=True))
    joint = JointConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.0, base_loss="kl")
    adapted = add_lora_adapter(base, joint)
    recipe = JointRecipe(adapted, head, joint).eval()
    mask = torch.ones_like(prompt)
    batch = {"input_ids": prompt, "loss_mask": mask, "attention_mask": mask}
    with torch.no_grad():
        # LoRA starts as identity (B = 0)
        assert float(recipe(batch, "validation").loss_parts["base_loss"]) == 0.0
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
        assert float(recipe(batch, "validation").loss_parts["base_loss"]) > 1e-4
        with adapted.disable_adapter():
            assert torch.equal(_logits(adapted, prompt), original)
        assert not torch.allclose(_logits(adapted, prompt), original, atol=1e-3)


def test_self_distillation_keeps_the_base_close_and_trains_the_heads(tmp_path):
    dataset = patterned_dataset()
    summary = run_training(
        _config(tmp_path / "run"), base_model=make_tiny_llama(), datasets=(dataset, dataset)
    )
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert records[0]["base_loss"] == 0.0  # KL(original || adapted) with the adapter at identity
    assert max(r["head_loss_weight"] for r in records) <= 0.01  # the self-distillation default peak
    assert max(r["base_loss"] for r in records) < 0.05
    assert summary.eval["top1"][0] > records[0]["top1"][0] + 0.05


def test_a_resumed_joint_run_ends_with_the_same_heads_and_adapter(tmp_path):
    dataset = patterned_dataset()
    options = ["train.max_steps=6", "train.save_every=3", "train.eval_every=3", "joint.base_loss=lm"]
    run_training(
        _config(tmp_path / "whole", *options), base_model=make_tiny_llama(), datasets=(dataset, dataset)
    )
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    (tmp_path / "whole" / "checkpoints" / "step-00000003").rename(stopped / "checkpoints" / "step-00000003")
    resumed = _config(stopped, *options, "train.resume=true")
    assert run_training(resumed, base_model=make_tiny_llama(), datasets=(dataset, dataset)).steps == 6
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        expected = load_file(str(tmp_path / "whole" / "head" / name))
        actual = load_file(str(stopped / "head" / name))
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_head_loss_weight_ramps_as_a_quarter_sine():
    assert head_loss_weight(0, 100, 0.2, 0.5) == 0.0
    assert head_loss_weight(25, 100, 0.2, 0.5) == pytest.approx(0.2 * math.sin(math.pi / 4))
    assert head_loss_weight(50, 100, 0.2, 0.5) == 0.2
    assert head_loss_weight(99, 100, 0.2, 0.5) == 0.2
    assert head_loss_weight(0, 100, 0.01, 0.0) == 0.01  # no ramp
    assert JointConfig().peak_lambda0() == 0.01 and JointConfig(base_loss="lm").peak_lambda0() == 0.2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["joint.base_loss=mse"], "joint.base_loss must be one of"),
        (["joint.lora_rank=0"], "joint.lora_rank must be >= 1"),
        (["joint.lambda0_warmup_ratio=2"], "joint.lambda0_warmup_ratio"),
        (["joint.lora_target_modules=[no_such_layer]"], "joint.lora_target_modules"),
        (["data.features=/tmp/somewhere"], "cannot feed head.joint training"),
        (["train.init_head=/tmp/somewhere"], "not supported for joint"),
    ],
)
def test_joint_config_errors_name_the_field(tmp_path, overrides, message):
    dataset = patterned_dataset(4)
    with pytest.raises(ConfigError, match=message):
        run_training(
            _config(tmp_path / "run", *overrides), base_model=make_tiny_llama(), datasets=(dataset, dataset)
        )


def test_export_keeps_the_adapter_and_the_card_says_outputs_follow_the_adapted_base(tmp_path):
    from draftheads.export import FormatError, export_head

    _, output_dir = _trained_lm_run(tmp_path)
    files = export_head(output_dir / "head", tmp_path / "export")
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in files}
    assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").is_file()
    assert "outputs follow the adapted base" in (tmp_path / "export" / "README.md").read_text()
    _, adapted = load_head_and_base(tmp_path / "export", make_tiny_llama())  # loads with its adapter
    assert getattr(adapted.config, MERGED_ADAPTER_KEY)
    with pytest.raises(FormatError, match="base adapter"):
        export_head(output_dir / "head", tmp_path / "vllm", "medusa-vllm")


def test_bench_gives_a_joint_head_its_own_base_and_keeps_the_shared_one_original(tmp_path):
    from draftheads.bench import speculative_methods

    _, output_dir = _trained_lm_run(tmp_path)
    shared = make_tiny_llama()
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    original = _logits(shared, prompt)
    plain_head = tmp_path / "plain"
    build_head(shared, MedusaConfig(num_heads=2)).save_pretrained(plain_head)
    methods = speculative_methods([str(output_dir / "head"), str(plain_head)], shared, None, "cpu-8", "cpu")
    joint, plain = (method.generator for method in methods)
    assert getattr(shared.config, MERGED_ADAPTER_KEY, None) is None
    torch.testing.assert_close(_logits(shared, prompt), original)
    assert joint.model is not shared and getattr(joint.model.config, MERGED_ADAPTER_KEY)
    assert plain.model is shared
    assert [method.name for method in methods] == ["medusa:run", "medusa:plain"]


@pytest.mark.skipif(not packing_supported(torch.nn.Linear(2, 2)), reason="no oneDNN fp32 packing here")
def test_bench_packs_a_joint_heads_own_base_after_the_merge(tmp_path):
    from draftheads.bench import speculative_methods

    _, output_dir = _trained_lm_run(tmp_path)
    head_dirs = [str(output_dir / "head")]
    (packed,) = speculative_methods(head_dirs, make_tiny_llama(), None, "cpu-8", "cpu", pack=True)
    (unpacked,) = speculative_methods(head_dirs, make_tiny_llama(), None, "cpu-8", "cpu")
    assert has_packed_linears(packed.generator.model) and has_packed_linears(packed.generator.head)
    assert not has_packed_linears(unpacked.generator.model)
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    # the merged adapter is in the packed weights: the same adapted base as the unpacked merge
    torch.testing.assert_close(
        _logits(packed.generator.model, prompt),
        _logits(unpacked.generator.model, prompt),
        rtol=1e-4,
        atol=1e-4,
    )
    greedy = [
        method.generator.generate(prompt, max_new_tokens=16).new_tokens for method in (packed, unpacked)
    ]
    assert greedy[0] == greedy[1]
