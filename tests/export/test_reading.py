"""Reading engine formats back (``draftheads.export.reading``): round trips through every format,
checkpoints published by others, with and without a base model, and their base model's name."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from format_fixtures import DRAFT_VOCAB, HIDDEN, VOCAB, assert_same_drafts, make_head, strip_metadata
from safetensors.torch import load_file

from draftheads.export import write_head
from draftheads.heads import HeadFormatError, HeadMismatchError, load_head, resolve_base_model
from tests.conftest import make_tiny_llama

ROUND_TRIPS = [
    ("draftheads", "medusa"),
    ("draftheads", "eagle"),
    ("draftheads", "eagle3"),
    ("draftheads", "mtp"),
    ("eagle3", "eagle3"),
    ("speculators", "eagle3"),
    ("eagle-sglang", "eagle"),
    ("medusa-vllm", "medusa"),
]


@pytest.mark.parametrize("format_name,kind", ROUND_TRIPS)
def test_round_trip_gives_identical_drafts(tiny_llama, tmp_path, format_name, kind):
    head = make_head(tiny_llama, kind)
    write_head(head, tmp_path, format_name)
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert type(loaded) is type(head) and loaded.config == head.config
    assert_same_drafts(head, loaded, tiny_llama)


@pytest.mark.parametrize("format_name", ["draftheads", "eagle3", "speculators"])
def test_eagle3_with_a_wider_mlp_round_trips(tiny_llama, tmp_path, format_name):
    head = make_head(
        tiny_llama, "eagle3", draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3), intermediate_size=192
    )
    written = write_head(head, tmp_path, format_name)
    if format_name != "draftheads":  # engines build the drafter's MLP from its own config
        layer = written.get("transformer_layer_config", written)
        assert layer["intermediate_size"] == 192 != tiny_llama.config.intermediate_size
    loaded = load_head(tmp_path, base_model=tiny_llama)
    assert loaded.config == head.config and loaded.midlayer.mlp.up_proj.weight.shape == (192, HIDDEN)
    assert_same_drafts(head, loaded, tiny_llama)
    if format_name == "eagle3":  # published by others: the width comes from the engine config
        strip_metadata(tmp_path)
        third_party = load_head(tmp_path, base_model=tiny_llama)
        assert third_party.config.intermediate_size == 192
        assert_same_drafts(head, third_party, tiny_llama)


def test_third_party_eagle3_without_base_says_what_was_not_checked(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    write_head(head, tmp_path, "eagle3")
    strip_metadata(tmp_path)
    with pytest.warns(UserWarning, match="not checked: base num_hidden_layers"):
        loaded = load_head(tmp_path)
    assert loaded.config.draft_vocab_size == DRAFT_VOCAB
    assert loaded.base_spec.hidden_size == HIDDEN and loaded.base_spec.vocab_size == VOCAB
    attached = load_head(tmp_path, base_model=tiny_llama)
    assert_same_drafts(head, attached, tiny_llama)


def test_third_party_checkpoint_that_does_not_fit_the_base_is_refused(tiny_llama, tmp_path):
    write_head(make_head(tiny_llama, "eagle3"), tmp_path, "eagle3")
    strip_metadata(tmp_path)
    wider = make_tiny_llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(HeadMismatchError, match="hidden_size=64 in the checkpoint.*hidden_size=96"):
        load_head(tmp_path, base_model=wider)


def test_reading_leaves_the_base_model_as_it_was(tiny_llama, tmp_path):
    write_head(make_head(tiny_llama, "medusa", shared_lm_head=True), tmp_path, "medusa-vllm")
    before = {name: tensor.clone() for name, tensor in tiny_llama.state_dict().items()}
    config_before = tiny_llama.config.to_dict()
    load_head(tmp_path, base_model=tiny_llama)
    assert tiny_llama.config.to_dict() == config_before
    assert all(torch.equal(before[name], tensor) for name, tensor in tiny_llama.state_dict().items())


def test_pickle_weights_are_read_with_weights_only_and_a_warning(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    write_head(head, tmp_path, "eagle3")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    with pytest.warns(UserWarning, match=r"weights_only=True"):
        loaded = load_head(tmp_path, base_model=tiny_llama)
    assert_same_drafts(head, loaded, tiny_llama)


def test_pickle_with_code_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    torch.save({"fc.weight": Payload()}, tmp_path / "pytorch_model.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="(?i)weights.only|unsupported global|not allowed"):
            load_head(tmp_path)


# ---- the base model an engine checkpoint names --------------------------------------------------


def test_base_model_of_an_engine_checkpoint(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    write_head(head, tmp_path / "ours", "eagle3")
    assert resolve_base_model(tmp_path / "ours") == "tiny-llama"  # from our metadata block
    assert resolve_base_model(tmp_path / "ours", "other/base") == "other/base"
    write_head(head, tmp_path / "speculators", "speculators")
    strip_metadata(tmp_path / "speculators")
    assert resolve_base_model(tmp_path / "speculators") == "tiny-llama"  # the speculators verifier


def test_an_engine_checkpoint_naming_no_base_says_which_fields_were_read(tiny_llama, tmp_path):
    write_head(make_head(tiny_llama, "eagle3"), tmp_path, "eagle3")
    strip_metadata(tmp_path)
    with pytest.raises(
        HeadFormatError, match="draftheads.base_model.name_or_path.*pass the base model"
    ) as caught:
        resolve_base_model(tmp_path)
    assert str(tmp_path / "config.json") in str(caught.value)
