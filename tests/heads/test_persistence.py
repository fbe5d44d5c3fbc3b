"""Registry, save_pretrained -> load_head round trips, refusal on a mismatched base model, a joint
(Medusa-2) head's adapted base, and the base model a head directory names."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from head_fixtures import (
    AUTOREGRESSIVE_KINDS,
    HEAD_CONFIGS,
    KINDS,
    base_hidden_states,
    make_tiny_llama,
    token_counts,
)

from draftheads.heads import (
    HeadFormatError,
    HeadMismatchError,
    MedusaConfig,
    build_head,
    head_class,
    load_head,
    load_head_and_base,
    resolve_base_model,
)
from draftheads.heads.adapter import MERGED_ADAPTER_KEY, adapted_base, adapter_fingerprint, merged_adapter
from draftheads.heads.base import head_config_from_dict
from draftheads.settings import ConfigError


def draft_outputs(head, model, input_ids):
    """What inference reads from a head, for comparing two heads."""
    hidden_states = base_hidden_states(model, input_ids)
    features = head.select_features(hidden_states)
    with torch.no_grad():
        if head.drafting == "parallel":
            return (head.draft_logits(features),)
        cache = head.new_cache()
        length = input_ids.shape[1]
        positions = torch.arange(length)[None].expand_as(input_ids)
        next_tokens = torch.roll(input_ids, -1, dims=1)
        hidden, logits = head.catch_up(cache, features, next_tokens, positions)
        return hidden, logits, head.draft_to_target(logits.argmax(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_registered(kind):
    assert head_class(kind).kind == kind


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown head kind 'hydra'.*eagle, eagle3, medusa, mtp"):
        head_class("hydra")
    with pytest.raises(ConfigError, match="head.kind"):
        head_config_from_dict({"kind": "hydra"}, "head")


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_gives_identical_outputs(kind, tiny_llama, tmp_path):
    torch.manual_seed(0)
    head = build_head(tiny_llama, HEAD_CONFIGS[kind], base_name="tiny-llama")
    input_ids = torch.randint(3, 256, (1, 10))
    head.init_from_data(token_counts(torch.randint(100, 256, (400,)), 256))  # a non-trivial draft vocab
    with torch.no_grad():  # move every weight away from its initial value
        for parameter in head.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    head.eval()
    head.save_pretrained(tmp_path / "head")

    loaded = load_head(tmp_path / "head", base_model=tiny_llama).eval()
    assert type(loaded) is type(head) and loaded.config == head.config
    assert loaded.feature_layers == head.feature_layers
    saved_state, loaded_state = head.state_dict(), loaded.state_dict()
    assert saved_state.keys() == loaded_state.keys()
    for name in saved_state:
        assert torch.equal(saved_state[name], loaded_state[name]), name
    for expected, actual in zip(
        draft_outputs(head, tiny_llama, input_ids), draft_outputs(loaded, tiny_llama, input_ids)
    ):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field, value", [("hidden_size", 32), ("vocab_size", 300)])
def test_loading_on_a_mismatched_base_is_refused(kind, field, value, tiny_llama, tmp_path):
    build_head(tiny_llama, HEAD_CONFIGS[kind]).save_pretrained(tmp_path / "head")
    other = make_tiny_llama(**{field: value})
    with pytest.raises(HeadMismatchError, match=f"{field}=.*{value}"):
        load_head(tmp_path / "head", base_model=other)


@pytest.mark.parametrize("kind", AUTOREGRESSIVE_KINDS)
def test_unknown_base_architecture_is_a_clear_error(kind):
    from transformers import GPT2Config

    supported = "gemma3_text, llama, mistral, qwen2, qwen3"
    with pytest.raises(ValueError, match=f"model_type 'gpt2'.*supported: {supported}"):
        head_class(kind)(HEAD_CONFIGS[kind], GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64))


def test_importing_heads_does_not_import_training_dependencies():
    code = (
        "import sys, draftheads.heads; "
        "loaded = [m for m in ('deepspeed', 'wandb', 'datasets') if m in sys.modules]; "
        "print(loaded); sys.exit(1 if loaded else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- joint (Medusa-2) heads: the base with the head's adapter merged ------------------------------


@pytest.fixture
def joint_head_dir(tmp_path):
    """A saved joint head with a non-trivial LoRA adapter in peft's format (what training writes)."""
    from peft import LoraConfig, get_peft_model

    head = build_head(
        make_tiny_llama(), MedusaConfig(num_heads=2, num_layers=1, joint=True), base_name="tiny-llama"
    )
    directory = head.save_pretrained(tmp_path / "joint")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    adapter = get_peft_model(make_tiny_llama(), lora)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in adapter.named_parameters():
            if "lora_B" in name:  # B = 0 at initialisation would make the adapter the identity
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    adapter.save_pretrained(str(directory / "adapter"), safe_serialization=True)
    return directory


def _snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}, model.config.to_dict()


def _assert_unchanged(model, snapshot):
    weights, config = snapshot
    assert model.config.to_dict() == config and MERGED_ADAPTER_KEY not in model.config.to_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor), name


@torch.no_grad()
def _logits(model, input_ids):
    return model(input_ids).logits


def test_joint_head_drafts_for_an_adapted_copy_and_the_base_is_untouched(joint_head_dir):
    from peft import PeftModel

    base = make_tiny_llama()
    before = _snapshot(base)
    head, model = load_head_and_base(joint_head_dir, base)
    _assert_unchanged(base, before)
    assert model is not base and merged_adapter(model) == adapter_fingerprint(joint_head_dir)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    prompt = torch.tensor([[5, 9, 13, 17, 21]])
    reference = PeftModel.from_pretrained(make_tiny_llama(), str(joint_head_dir / "adapter")).eval()
    torch.testing.assert_close(_logits(model, prompt), _logits(reference, prompt), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_logits(model, prompt), _logits(base, prompt), atol=1e-3)
    # the head reads the adapted model's frozen parts, and drafts from its hidden states
    assert (
        head.embed_tokens is model.get_input_embeddings()
        and head.base_lm_head is model.get_output_embeddings()
    )
    adapted_drafts = head.draft_logits(base_hidden_states(model, prompt)[-1])
    assert not torch.allclose(
        adapted_drafts, head.draft_logits(base_hidden_states(base, prompt)[-1]), atol=1e-4
    )
    # the adapted model already carries the adapter: loading against it again merges nothing
    again, same = load_head_and_base(joint_head_dir, model)
    assert same is model and again.base_lm_head is model.get_output_embeddings()
    assert load_head(joint_head_dir, base_model=model).config.joint


def test_a_joint_head_on_a_base_without_its_adapter_is_refused(joint_head_dir):
    base = make_tiny_llama()
    before = _snapshot(base)
    with pytest.raises(HeadMismatchError, match="joint \\(Medusa-2\\) head.*load_head_and_base"):
        load_head(joint_head_dir, base_model=base)
    _assert_unchanged(base, before)
    setattr(base.config, MERGED_ADAPTER_KEY, "0123456789abcdef")  # another head's adapter
    with pytest.raises(
        HeadMismatchError, match="already has adapter 0123456789abcdef merged.*load_head_and_base"
    ):
        load_head(joint_head_dir, base_model=base)
    with pytest.raises(HeadMismatchError, match="already has adapter 0123456789abcdef merged"):
        adapted_base(base, joint_head_dir)  # never merged twice


def test_a_joint_head_on_a_base_that_does_not_fit_is_refused_before_the_copy(joint_head_dir):
    with pytest.raises(HeadMismatchError, match="hidden_size=64"):
        load_head_and_base(joint_head_dir, make_tiny_llama(hidden_size=32))


def test_a_plain_head_drafts_for_the_base_itself(tiny_llama, tmp_path):
    build_head(tiny_llama, HEAD_CONFIGS["eagle3"]).save_pretrained(tmp_path / "head")
    before = _snapshot(tiny_llama)
    head, model = load_head_and_base(tmp_path / "head", tiny_llama)
    assert model is tiny_llama and head.embed_tokens is tiny_llama.get_input_embeddings()
    _assert_unchanged(tiny_llama, before)


# ---- the base model a head directory names ------------------------------------------------------


def test_resolve_base_model_prefers_the_given_base_then_the_recorded_one(tiny_llama, tmp_path):
    build_head(tiny_llama, HEAD_CONFIGS["medusa"], base_name="org/base").save_pretrained(tmp_path / "head")
    assert resolve_base_model(tmp_path / "head") == "org/base"
    assert resolve_base_model(tmp_path / "head", "other/base") == "other/base"
    assert resolve_base_model(tmp_path / "nowhere", "other/base") == "other/base"  # nothing read


def test_resolve_base_model_error_names_the_file_and_the_field(tiny_llama, tmp_path):
    build_head(tiny_llama, HEAD_CONFIGS["medusa"]).save_pretrained(tmp_path / "head")  # the base has no name
    config_path = tmp_path / "head" / "config.json"
    with pytest.raises(HeadFormatError) as caught:
        resolve_base_model(tmp_path / "head")
    message = str(caught.value)
    assert message.startswith(f"{config_path}: ") and "base_model.name_or_path" in message
    assert "pass the base model explicitly" in message


def test_a_directory_without_config_is_one_error_type(tmp_path):
    for call in (lambda: resolve_base_model(tmp_path), lambda: load_head(tmp_path)):
        with pytest.raises(HeadFormatError, match=f"no config.json in head directory {tmp_path}"):
            call()
