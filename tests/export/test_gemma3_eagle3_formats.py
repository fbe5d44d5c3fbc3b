"""EAGLE-3 heads on a tiny random Gemma 3 in the engine formats. The engines build an EAGLE-3 drafter
as a Llama layer whatever the target (vLLM llama_eagle3.py, llama.cpp src/models/eagle3.cpp), so a
head with ``layer_architecture: llama`` exports to ``eagle3`` and ``speculators`` and reads back
drafting the same logits, while a head of Gemma 3 layers is refused in one line by every engine
format instead of being written as a file the engines would misread."""

from __future__ import annotations

import math

import pytest
import torch
from format_fixtures import assert_same_drafts, make_head, write_target

from draftheads.export import FormatError, write_head
from draftheads.export.registry import ExportOptions
from draftheads.heads import load_head
from draftheads.heads.eagle3 import Eagle3Config, Eagle3Head
from draftheads.settings import ConfigError
from tests.conftest import make_tiny_gemma3

pytestmark = pytest.mark.usefixtures("single_thread")
LAYERS = (1, 2, 3)


@pytest.fixture(scope="module")
def gemma3():
    return make_tiny_gemma3()


def llama_layout_head(base):
    return make_head(base, "eagle3", draft_vocab_size=100, feature_layers=LAYERS, layer_architecture="llama")


def test_a_llama_layout_head_builds_a_silu_llama_layer_of_the_base_geometry(gemma3):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    head = llama_layout_head(gemma3)
    assert isinstance(head.midlayer, LlamaDecoderLayer) and isinstance(head.norm, LlamaRMSNorm)
    layer, base = head.layer_config, gemma3.config
    assert layer.model_type == "llama" and layer.hidden_act == "silu"
    assert (layer.hidden_size, layer.head_dim, layer.num_key_value_heads) == (64, 24, 2)
    assert layer.rope_parameters["rope_theta"] == base.rope_parameters["full_attention"]["rope_theta"]
    own = make_head(gemma3, "eagle3", draft_vocab_size=100, feature_layers=LAYERS)
    assert own.layer_config is base and type(own.midlayer).__name__ == "Gemma3DecoderLayer"


@pytest.mark.parametrize("format_name", ["eagle3", "speculators"])
def test_a_llama_layout_head_exports_and_reads_back_the_same_drafts(gemma3, tmp_path, format_name):
    head = llama_layout_head(gemma3)
    config = write_head(head, tmp_path, format_name)
    layer = config.get("transformer_layer_config", config)
    assert layer["model_type"] == "llama" and layer["hidden_act"] == "silu"
    assert layer["num_hidden_layers"] == 1 and layer["head_dim"] == 24
    assert layer["rope_theta"] == gemma3.config.rope_parameters["full_attention"]["rope_theta"]
    assert "layer_types" not in layer and "sliding_window" not in layer  # nothing Gemma-only
    loaded = load_head(tmp_path, base_model=gemma3)
    assert loaded.config.layer_architecture == "llama"
    assert_same_drafts(head, loaded, gemma3)
    rebuilt = load_head(tmp_path)  # no base: its config rebuilt from the checkpoint and our metadata
    assert rebuilt.base_config.model_type == "gemma3_text"
    assert_same_drafts(head, rebuilt.attach(gemma3), gemma3)


@pytest.mark.parametrize("format_name", ["eagle3", "speculators", "gguf"])
def test_a_head_of_gemma3_layers_is_refused_by_the_engine_formats(gemma3, tmp_path, format_name):
    head = make_head(gemma3, "eagle3", draft_vocab_size=100, feature_layers=LAYERS)
    with pytest.raises(FormatError) as error:
        write_head(head, tmp_path / "out", format_name, ExportOptions(target_gguf=str(tmp_path / "t.gguf")))
    message = str(error.value)
    assert "\n" not in message and "gemma3_text" in message and "Llama decoder layer" in message
    assert not (tmp_path / "out" / "config.json").exists()


def test_gguf_writes_a_llama_layout_head_with_the_layer_s_full_attention_rope(gemma3, tmp_path):
    """Gemma 3 keeps one RoPE per attention type (theta 1e6 full, 1e4 sliding); the drafter's GGUF
    carries the draft layer's (full attention), as llama.cpp's converter writes it from our eagle3
    export, and its geometry (4 heads of 24, 2 KV heads)."""
    from gguf import GGUFReader

    from draftheads.export.gguf import GGUF_NAME

    config = gemma3.config
    target = write_target(
        tmp_path / "t.gguf", config.vocab_size, config.hidden_size, config.num_hidden_layers, "gemma3"
    )
    options = ExportOptions(target_gguf=str(target))
    write_head(llama_layout_head(gemma3), tmp_path / "out", "gguf", options)
    fields = GGUFReader(tmp_path / "out" / GGUF_NAME).fields
    rope = gemma3.config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    freq_base = fields["eagle3.rope.freq_base"].contents()
    assert math.isclose(freq_base, rope["full_attention"]["rope_theta"], rel_tol=1e-6)
    assert fields["eagle3.attention.key_length"].contents() == 24
    assert fields["eagle3.attention.head_count_kv"].contents() == 2
    assert fields["eagle3.vocab_size"].contents() == gemma3.config.vocab_size


def test_init_from_base_cannot_copy_a_gemma3_layer_into_a_llama_one(gemma3):
    config = Eagle3Config(feature_layers=LAYERS, layer_architecture="llama", init_from_base=True)
    with pytest.raises(ConfigError, match="head.layer_architecture=llama builds another layout"):
        Eagle3Head(config, gemma3.config).init_from_base(gemma3)
    with pytest.raises(ValueError, match="layer_architecture must be null or one of"):
        Eagle3Config(layer_architecture="qwen3")


def test_the_input_norm_absorbs_gemma_s_embedding_scale(gemma3):
    """The head embeds through Gemma's module (rows x sqrt(hidden_size)); vLLM and llama.cpp feed an
    EAGLE-3 drafter the raw rows of the target's table. Both go through input_layernorm first,
    where they agree up to its epsilon."""
    head = llama_layout_head(gemma3)
    head.attach(gemma3)
    tokens = torch.arange(3, 40)[None]
    scaled = head.embed_tokens(tokens)
    raw = gemma3.get_input_embeddings().weight[tokens]
    torch.testing.assert_close(scaled, raw * math.sqrt(64))
    norm = head.midlayer.input_layernorm
    with torch.no_grad():
        ratio = norm(scaled) / norm(raw)  # sqrt((ms + eps) / (ms + eps / h)), ms = mean square of a raw row
    bound = norm.variance_epsilon / (2 * raw.pow(2).mean(-1).min())  # first order in eps / ms
    assert 0 < float((ratio - 1).abs().max()) <= 1.01 * float(bound)
