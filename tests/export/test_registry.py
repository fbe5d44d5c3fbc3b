"""The export registries (``draftheads.export.registry``): formats a head kind fits, and readers that
recognise a foreign config.json by its own fields, with clear refusals either way."""

from __future__ import annotations

import json

import pytest
import torch
from format_fixtures import make_head
from safetensors.torch import save_file

from draftheads.export import (
    FORMAT_REGISTRY,
    READER_REGISTRY,
    EngineReader,
    FormatError,
    export_format,
    find_reader,
    formats_for,
    write_head,
)
from draftheads.heads import HeadFormatError, load_head


def test_every_format_and_reader_is_registered_in_order():
    assert list(FORMAT_REGISTRY) == [
        "draftheads",
        "eagle3",
        "speculators",
        "eagle",
        "eagle-sglang",
        "medusa-vllm",
        "mtp-deepseek",
        "dflash",
        "dflash-speculators",
        "gguf",
    ]
    assert list(READER_REGISTRY) == [
        "eagle3",
        "speculators",
        "speculators-peagle",
        "eagle",
        "medusa-vllm",
        "dflash",
        "dflash-speculators",
    ]
    assert formats_for("eagle3") == ["draftheads", "eagle3", "speculators", "gguf"]
    assert formats_for("dflash") == ["draftheads", "dflash", "dflash-speculators"]
    assert formats_for("peagle") == ["draftheads", "speculators"]


def test_format_that_cannot_hold_the_head_is_refused_with_alternatives(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    alternatives = "draftheads, eagle3, speculators, gguf"
    with pytest.raises(FormatError, match=f"cannot express a eagle3 head.*{alternatives}"):
        write_head(head, tmp_path, "medusa-vllm")
    with pytest.raises(FormatError, match="unknown export format 'onnx'"):
        export_format("onnx", "eagle3")
    for name, chosen in FORMAT_REGISTRY.items():
        for kind in ("medusa", "eagle", "eagle3", "mtp"):
            if kind not in chosen.head_kinds:
                with pytest.raises(FormatError):
                    export_format(name, kind)


@pytest.mark.parametrize(
    "saved, expected",
    [
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3"),
        ({"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}, "speculators"),
        ({"architectures": ["EagleLlamaForCausalLM"]}, "eagle"),
        ({"architectures": ["LlamaForCausalLMEagle"]}, "eagle"),
        ({"architectures": ["MedusaModel"], "model_type": "medusa"}, "medusa-vllm"),
    ],
)
def test_a_reader_recognises_its_config(saved, expected, tmp_path):
    assert find_reader(saved, {}, tmp_path / "config.json").name == expected


@pytest.mark.parametrize("fc_inputs, expected", [(2, "eagle"), (3, "eagle3")])
def test_unlabelled_release_is_recognised_by_its_tensors(fc_inputs, expected, tmp_path):
    # SafeAILab's EAGLE releases say "LlamaForCausalLM"; fc reads 2 (EAGLE-1) or 3 (EAGLE-3) states
    tensors = {
        "fc.weight": torch.zeros(4, 4 * fc_inputs),
        "layers.0.self_attn.q_proj.weight": torch.zeros(4, 4),
    }
    assert (
        find_reader({"architectures": ["LlamaForCausalLM"]}, tensors, tmp_path / "config.json").name
        == expected
    )


def test_unknown_foreign_format_is_refused_naming_the_file_and_what_is_readable(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    save_file({"wte.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match="readable: draftheads, eagle3") as caught:
        load_head(tmp_path)
    message = str(caught.value)
    assert str(tmp_path / "config.json") in message and "GPT2LMHeadModel" in message
    assert "speculators eagle3" in message and "medusa-vllm (MedusaModel)" in message
    assert isinstance(caught.value, HeadFormatError)  # one error type for an unreadable head directory


def test_a_config_two_readers_recognise_is_refused(tmp_path, monkeypatch):
    class AnyConfig(EngineReader):
        name = "greedy"
        kind = "eagle3"

        def recognises(self, saved):
            return True

    monkeypatch.setitem(READER_REGISTRY, "greedy", AnyConfig())
    with pytest.raises(FormatError, match="recognised as several formats \\(eagle3, greedy\\)"):
        find_reader({"architectures": ["LlamaForCausalLMEagle3"]}, {}, tmp_path / "config.json")
