"""The ``gguf`` format (``draftheads.export.gguf``): the layout llama.cpp's EAGLE-3 loader builds, and
the f32 copy of a quantised base GGUF.

Sources of the asserted names and shapes (ggml-org/llama.cpp): src/models/eagle3.cpp
``load_arch_hparams`` (``eagle3.target_layers``, exactly 3; ``eagle3.target_hidden_size``) and
``load_arch_tensors`` (``fc`` {3 * n_embd_tgt, n_embd}; ``attn_q/k/v`` {2 * n_embd, ...}; ``output``
{n_embd, n_draft_vocab}; ``d2t`` I64 {n_draft_vocab}; ``attn_norm_2``; ``token_embd`` optional);
convert_hf_to_gguf.py (``d2t`` written as ``d2t + arange``, unique and inside the target vocabulary;
``LlamaModel.permute`` on q/k). ggml shapes list the fastest dimension first (numpy's reversed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from format_fixtures import DRAFT_VOCAB, HEAD_DIM, HIDDEN, KV_HEADS, VOCAB, make_head, write_target
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from draftheads.export import ExportOptions, FormatError, write_head
from draftheads.export.gguf import GGUF_NAME, permute_rope_rows, write_dequantized_gguf

HEADS = 4  # tests/conftest.py TINY_LLAMA


@pytest.fixture
def exported(tiny_llama, tmp_path):
    head = make_head(tiny_llama, "eagle3")
    target = write_target(tmp_path / "target.gguf")
    metadata = write_head(head, tmp_path / "out", "gguf", ExportOptions(target_gguf=str(target)))
    return head, GGUFReader(tmp_path / "out" / GGUF_NAME), metadata


def test_gguf_layout_matches_llama_cpp_eagle3_loader(exported):
    _, reader, metadata = exported
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    layer = {
        "attn_norm": [HIDDEN],
        "attn_norm_2": [HIDDEN],
        "attn_q": [2 * HIDDEN, HEADS * HEAD_DIM],
        "attn_k": [2 * HIDDEN, KV_HEADS * HEAD_DIM],
        "attn_v": [2 * HIDDEN, KV_HEADS * HEAD_DIM],
        "attn_output": [HEADS * HEAD_DIM, HIDDEN],
        "ffn_norm": [HIDDEN],
        "ffn_gate": [HIDDEN, 128],
        "ffn_up": [HIDDEN, 128],
        "ffn_down": [128, HIDDEN],
    }
    expected = {f"blk.0.{k}.weight": v for k, v in layer.items()} | {
        "fc.weight": [3 * HIDDEN, HIDDEN],
        "output_norm.weight": [HIDDEN],
        "output.weight": [HIDDEN, DRAFT_VOCAB],
        "d2t": [DRAFT_VOCAB],
    }
    assert shapes == expected  # no token_embd: the drafter reads the target's
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["d2t"] == GGMLQuantizationType.I64
    assert all(types[name] == GGMLQuantizationType.F32 for name in expected if name != "d2t")

    def value(key):
        return reader.fields[key].contents()

    assert value("general.architecture") == "eagle3" and value("general.file_type") == 0
    assert value("eagle3.target_layers") == [1, 2, 3]  # inputs of target layers = hs indices
    assert value("eagle3.target_hidden_size") == HIDDEN and value("eagle3.block_count") == 1
    assert value("eagle3.feed_forward_length") == 128 and value("eagle3.embedding_length") == HIDDEN
    assert (
        value("eagle3.attention.head_count") == HEADS and value("eagle3.attention.head_count_kv") == KV_HEADS
    )
    assert value("eagle3.rope.dimension_count") == HEAD_DIM and value("eagle3.vocab_size") == VOCAB
    assert value("eagle3.norm_before_residual") is False and value("eagle3.norm_before_fc") is False
    assert math.isclose(value("eagle3.attention.layer_norm_rms_epsilon"), 1e-6, rel_tol=1e-6)
    # the target's vocabulary travels with the draft (llama.cpp sizes its logits by it)
    assert value("tokenizer.ggml.tokens") == [f"t{i}" for i in range(VOCAB)]
    assert value("tokenizer.ggml.eos_token_id") == 2
    assert metadata["eagle3.target_layers"] == [1, 2, 3]


def test_gguf_tensors_are_the_head_s(exported):
    head, reader, _ = exported
    state = head.head_state_dict()
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert torch.equal(tensors["fc.weight"], state["fc.weight"])
    assert torch.equal(tensors["output.weight"], state["lm_head.weight"])
    assert torch.equal(tensors["blk.0.attn_norm_2.weight"], state["midlayer.hidden_norm.weight"])
    assert torch.equal(tensors["blk.0.attn_v.weight"], state["midlayer.self_attn.v_proj.weight"])
    q = state["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(tensors["blk.0.attn_q.weight"], permute_rope_rows(q, HEADS))
    assert not torch.equal(tensors["blk.0.attn_q.weight"], q)
    # absolute target ids: unique, inside the vocabulary, the head's d -> d + d2t[d]
    d2t = tensors["d2t"]
    assert torch.equal(d2t, torch.arange(DRAFT_VOCAB) + state["d2t"])
    assert len(set(d2t.tolist())) == DRAFT_VOCAB and 0 <= int(d2t.min()) and int(d2t.max()) < VOCAB


def rotate_half_rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """HF Llama RoPE on one head's vector (pairs i and i + d/2)."""
    half = x.shape[-1] // 2
    angle = position * theta ** (-torch.arange(half, dtype=torch.float64) / half)
    first, second = x[:half], x[half:]
    return torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()])


def adjacent_pairs_rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM on one head's vector (pairs 2i and 2i + 1)."""
    half = x.shape[-1] // 2
    angle = position * theta ** (-torch.arange(half, dtype=torch.float64) / half)
    even, odd = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2], out[1::2] = even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()
    return out


def attention_scores(rope, wq: torch.Tensor, wk: torch.Tensor, heads: int) -> list[float]:
    """q . k per head after ``rope``, for fixed inputs at positions 7 (query) and 3 (key)."""
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(wq.shape[1], generator=generator, dtype=torch.float64) for _ in range(2))
    q, k = (wq @ x).view(heads, -1), (wk @ y).view(heads, -1)
    return [float(rope(q[h], 7, 1e4) @ rope(k[h], 3, 1e4)) for h in range(heads)]


def test_permuted_rows_give_llama_cpp_rope_the_same_attention_scores():
    generator = torch.Generator().manual_seed(0)
    heads, head_dim, inputs = 2, 8, 6
    wq, wk = (
        torch.randn(heads * head_dim, inputs, generator=generator, dtype=torch.float64) for _ in range(2)
    )
    hf = attention_scores(rotate_half_rope, wq, wk, heads)
    permuted = permute_rope_rows(wq, heads), permute_rope_rows(wk, heads)
    llama_cpp = attention_scores(adjacent_pairs_rope, *permuted, heads)
    assert llama_cpp == pytest.approx(hf, rel=1e-12)
    unpermuted = attention_scores(adjacent_pairs_rope, wq, wk, heads)
    assert unpermuted != pytest.approx(hf, rel=1e-3)  # the permutation is what makes them agree


def test_gguf_refuses_a_target_of_another_base(tiny_llama, tmp_path):
    target = write_target(tmp_path / "other.gguf", vocab=VOCAB + 1)
    options = ExportOptions(target_gguf=str(target))
    with pytest.raises(FormatError, match=f"other.gguf has vocabulary {VOCAB + 1}.* {VOCAB}"):
        write_head(make_head(tiny_llama, "eagle3"), tmp_path / "out", "gguf", options)


def test_gguf_needs_the_target_gguf_of_a_base_that_ships_none(tiny_llama, tmp_path):
    with pytest.raises(FormatError, match="'tiny-llama' ships none here: pass --target-gguf"):
        write_head(make_head(tiny_llama, "eagle3"), tmp_path / "out", "gguf")
    missing = ExportOptions(target_gguf=str(tmp_path / "absent.gguf"))
    with pytest.raises(FormatError, match="absent.gguf is not a file"):
        write_head(make_head(tiny_llama, "eagle3"), tmp_path / "out", "gguf", missing)


def test_dequantized_gguf_holds_the_same_weights_in_f32(tmp_path):
    weights = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    source = tmp_path / "q8.gguf"
    fields = [
        ("llama.block_count", 2, GGUFValueType.UINT32, None),
        ("general.file_type", 7, GGUFValueType.UINT32, None),  # MOSTLY_Q8_0
        ("tokenizer.ggml.tokens", ["a", "b"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ]
    quantised = quantize(weights, GGMLQuantizationType.Q8_0)
    norm = np.ones(64, np.float32)
    writer = GGUFWriter(str(source), "llama")
    for key, value, main, item in fields:
        writer.add_key_value(key, value, main, item)
    writer.add_tensor("w.weight", quantised, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    write_dequantized_gguf(source, tmp_path / "f32.gguf")
    reader = GGUFReader(tmp_path / "f32.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in tensors.values())
    assert np.array_equal(tensors["w.weight"].data, dequantize(quantised, GGMLQuantizationType.Q8_0))
    assert np.array_equal(tensors["norm.weight"].data, norm)
    assert reader.fields["general.file_type"].contents() == 0
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
