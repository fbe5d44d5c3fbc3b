"""Registry, save_pretrained -> load_head round trips, and refusal on a mismatched base model."""

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

from draftheads.settings import ConfigError
from draftheads.heads import HeadMismatchError, build_head, head_class, load_head
from draftheads.heads.base import head_config_from_dict


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

    with pytest.raises(ValueError, match="model_type 'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
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
