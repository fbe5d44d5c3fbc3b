"""GGUF for llama.cpp: EAGLE-3 heads as the drafter of ``--spec-type draft-eagle3``, and a quantised
base GGUF dequantised to f32 (the dtype whose greedy output is llama.cpp's own reference).

The layout is what llama.cpp's EAGLE-3 loader builds (ggml-org/llama.cpp src/models/eagle3.cpp,
PR 18039) and what its converter writes for an EAGLE-3 checkpoint (convert_hf_to_gguf.py,
``LlamaModel`` with ``--target-model-dir``):

- ``general.architecture`` ``eagle3``, one decoder layer, the hyperparameters of the head's Llama layer;
  ``eagle3.target_layers``: the three capture layers as "input of target layer i"
  (common/speculative.cpp ``llama_set_embeddings_layer_inp``), which are our HF ``hidden_states``
  indices; ``eagle3.target_hidden_size``; ``norm_before_residual`` and ``norm_before_fc`` false.
- ``fc.weight`` (3h -> h), ``blk.0.attn_norm`` (our ``input_layernorm``, on the token embedding),
  ``blk.0.attn_norm_2`` (our ``hidden_norm``, on g), ``blk.0.attn_{q,k,v}`` reading
  concat(embedding, g) (embedding first, as ours), ``attn_output``, ``ffn_norm``,
  ``ffn_{gate,up,down}``, ``output_norm``, ``output`` (the draft vocabulary).
- ``d2t``: I64 absolute target ids (ours stores offsets: target = draft + d2t[draft]); llama.cpp
  scatters the draft logits into a full-vocabulary row with it.
- no ``token_embd``: the drafter reads the target's embedding (eagle3.cpp, ``ctx_other``).
- q/k rows permuted from HF's rotate-half RoPE layout to llama.cpp's adjacent pairs
  (``LLAMA_ROPE_TYPE_NORM``), as the converter's ``LlamaModel.permute``.
- the vocabulary is the target's: llama.cpp sizes the drafter's logits by its own vocabulary, and a
  draft must share the target's tokens, so the ``tokenizer.*`` fields are copied from the target GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from draftheads.export.draft_layer import require_engine_features, require_llama_layer, rope_fields
from draftheads.export.eagle3 import eagle3_tensors, refuse_eagle31
from draftheads.export.registry import ExportOptions, FormatError, register_writer
from draftheads.heads.base import DraftHead

ARCHITECTURE = "eagle3"
GGUF_NAME = "eagle3-draft.gguf"  # llama.cpp's web UI recognises ``eagle3-<name>.gguf`` as a drafter
# our tensor name (``eagle3_tensors`` with the layer under "midlayer.") -> llama.cpp's
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}
# ggml file types (llama.h ``llama_ftype``) by the matrices' dtype: all f32, or f16 with f32 vectors.
FILE_TYPE = {"float32": 0, "float16": 1}


# ---- tensors ------------------------------------------------------------------------------------


def permute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows from HF's rotate-half order (each head: first half, second half) to
    llama.cpp's interleaved pairs; (heads * head_dim, in) -> same shape."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_tensors(head: DraftHead):
    """The head's tensors under llama.cpp's names, as numpy arrays: matrices in the head's dtype
    (bf16 widened to f32, which is exact), vectors in f32, ``d2t`` as absolute target ids (I64)."""
    state = eagle3_tensors(head, "midlayer.")
    matrix_dtype = torch.float16 if state["fc.weight"].dtype == torch.float16 else torch.float32
    config = head.layer_config  # the draft layer's heads (a Llama-layout layer of the base's geometry)
    heads = {
        "midlayer.self_attn.q_proj.weight": config.num_attention_heads,
        "midlayer.self_attn.k_proj.weight": config.num_key_value_heads,
    }
    out = {}
    for name, gguf_name in TENSOR_NAMES.items():
        value = state[name].detach().cpu()
        if name in heads:
            value = permute_rope_rows(value, heads[name])
        value = value.to(matrix_dtype if value.dim() > 1 else torch.float32)
        out[gguf_name] = value.contiguous().numpy()
    draft_ids = torch.arange(state["d2t"].shape[0], dtype=torch.int64)
    out["d2t"] = (draft_ids + state["d2t"].cpu()).numpy()  # (N,) target id of each draft id
    return out


# ---- metadata -----------------------------------------------------------------------------------


def hyperparameters(head: DraftHead) -> dict[str, Any]:
    """The ``eagle3.*`` keys llama.cpp's loader reads: the draft layer's Llama geometry, one layer, the
    head's MLP width, and where the features come from. Python types pick the GGUF types (int ->
    uint32, float -> float32, bool, list of int -> int32 array). The geometry and RoPE are the draft
    layer's own (``head.layer_config``): for a base with several RoPE settings (Gemma 3: one per
    attention type) that is the full-attention one the layer was built with."""
    config = head.layer_config
    rope = rope_fields(config)
    if "rope_scaling" in rope:
        # llama.cpp's converter turns llama3 scaling into a rope_freqs tensor; this writer does not
        raise FormatError(
            f"format 'gguf': the base uses RoPE scaling {rope['rope_scaling']}; write --format eagle3 "
            "and convert it with llama.cpp's convert_hf_to_gguf.py --target-model-dir BASE"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    keys = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": 1,
        "feed_forward_length": head.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "rope.freq_base": float(rope.get("rope_theta", 10000.0)),
        "rope.dimension_count": head_dim,
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "vocab_size": head.base_spec.vocab_size,
        "target_layers": [int(layer) for layer in head.feature_layers],
        "target_hidden_size": config.hidden_size,
        "norm_before_residual": False,  # EAGLE-3's residual is the un-normed fc output, as ours
        "norm_before_fc": False,
    }
    return {f"{ARCHITECTURE}.{key}": value for key, value in keys.items()}


def value_type(value):
    """The GGUF type of a Python value (and of its items, for a list)."""
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32, None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, list) and all(isinstance(item, int) for item in value):
        return GGUFValueType.ARRAY, GGUFValueType.INT32
    raise TypeError(f"no GGUF type for {value!r}")


def copied_fields(reader, prefix: str) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, item type) of every field of a ``GGUFReader`` whose key starts with
    ``prefix``, as ``GGUFWriter.add_key_value`` takes them."""
    from gguf import GGUFValueType

    fields = []
    for field in reader.fields.values():
        if not field.name.startswith(prefix):
            continue
        main = field.types[0]
        item = field.types[-1] if main == GGUFValueType.ARRAY else None
        fields.append((field.name, field.contents(), main, item))
    return fields


# ---- the target ---------------------------------------------------------------------------------


def target_gguf_path(head: DraftHead, options: ExportOptions) -> Path:
    """The GGUF of the base llama.cpp verifies with: ``options.target_gguf``, or the embedded GGUF of
    an embedded base (``draftheads.base_model.ALIASES``)."""
    from draftheads.base_model import ALIASES, locate_embedded

    if options.target_gguf:
        path = Path(options.target_gguf)
        if not path.is_file():
            raise FormatError(f"format 'gguf': --target-gguf {path} is not a file")
        return path
    base = head.base_spec.name_or_path
    if base in ALIASES:
        return locate_embedded(base)
    raise FormatError(
        f"format 'gguf': the draft shares the target's vocabulary, read from the target's GGUF; the base "
        f"'{base}' ships none here: pass --target-gguf (llama.cpp's convert_hf_to_gguf.py writes one)"
    )


def read_target(path: Path):
    """A ``GGUFReader`` of the target GGUF ``path``; a file that is not a whole GGUF (another file's
    text, a truncated download) raises FormatError naming it, where the reader would fail on a
    magic number or a reshape."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError) as err:  # the bad magic, a tensor past the end, ...
        raise FormatError(f"format 'gguf': target GGUF {path}: not a readable GGUF file ({err})") from err


def target_field(reader, path: Path, key: str):
    """The field ``key`` of the target GGUF; FormatError naming file and field if it has none."""
    if key not in reader.fields:
        raise FormatError(f"format 'gguf': target GGUF {path}: no field '{key}'")
    return reader.fields[key]


def check_target(reader, path: Path, head: DraftHead) -> None:
    """Refuse a target GGUF that is not the head's base: its vocabulary, width and depth."""
    architecture = target_field(reader, path, "general.architecture").contents()
    vocab = len(target_field(reader, path, "tokenizer.ggml.tokens").data)
    found = {
        "vocabulary": vocab,
        "hidden size": target_field(reader, path, f"{architecture}.embedding_length").contents(),
        "layers": target_field(reader, path, f"{architecture}.block_count").contents(),
    }
    expected = {
        "vocabulary": head.base_spec.vocab_size,
        "hidden size": head.base_spec.hidden_size,
        "layers": head.base_spec.num_hidden_layers,
    }
    for what, value in found.items():
        if value != expected[what]:
            raise FormatError(
                f"format 'gguf': target GGUF {path} has {what} {value}, the head's base "
                f"'{head.base_spec.name_or_path}' {expected[what]}"
            )


# ---- writers ------------------------------------------------------------------------------------


def write_gguf_file(path: Path, architecture: str, fields, tensors) -> None:
    """One GGUF file: ``fields`` as (key, value, type, item type), then ``tensors`` (name -> array)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    for key, value, main, item in fields:
        writer.add_key_value(key, value, main, item)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@register_writer("gguf", ("eagle3",), "llama.cpp (`llama-server -md FILE --spec-type draft-eagle3`)")
def write_gguf(head: DraftHead, directory: Path, options: ExportOptions) -> dict[str, Any]:
    """``eagle3-draft.gguf``; returns its metadata besides the copied tokenizer fields."""
    require_llama_layer(head.layer_config, "gguf")
    require_engine_features(head, "gguf")
    refuse_eagle31(head, "gguf")  # llama.cpp's EAGLE-3 graph (src/models/eagle3.cpp) has no fc norms
    tensors = gguf_tensors(head)
    target = target_gguf_path(head, options)
    reader = read_target(target)
    check_target(reader, target, head)
    metadata = {
        "general.name": f"{head.base_spec.name_or_path} EAGLE-3 draft",
        "general.file_type": FILE_TYPE[tensors["fc.weight"].dtype.name],
    }
    metadata.update(hyperparameters(head))
    fields = [(key, value, *value_type(value)) for key, value in metadata.items()]
    write_gguf_file(
        directory / GGUF_NAME, ARCHITECTURE, fields + copied_fields(reader, "tokenizer."), tensors
    )
    return metadata


def write_dequantized_gguf(source: Path, target: Path) -> None:
    """``source`` with every tensor dequantised to f32 and its file type set to all-f32: the same
    weights (transformers dequantises a GGUF the same way), in the dtype whose greedy output is
    llama.cpp's reference for its own speculative decoding."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    fields = [
        field
        for field in copied_fields(reader, "")
        if not field[0].startswith("GGUF.") and field[0] not in ("general.architecture", "general.file_type")
    ]
    fields.append(("general.file_type", 0, GGUFValueType.UINT32, None))
    tensors = {t.name: dequantize(t.data, t.tensor_type).astype("float32") for t in reader.tensors}
    write_gguf_file(target, architecture, fields, tensors)
