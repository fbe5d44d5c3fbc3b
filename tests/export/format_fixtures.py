"""Shared by the export tests: one perturbed head per kind on the tiny Llama, and what decoding reads
from a head, to compare a head with its exported-and-read-back copy.

Imported by name (pytest puts this folder on sys.path); not a conftest.py, which would shadow the
root one.
"""

from __future__ import annotations

import json

import torch

from draftheads.export import DRAFTHEADS_KEY
from draftheads.heads import build_head
from draftheads.heads.eagle import EagleConfig
from draftheads.heads.eagle3 import Eagle3Config
from draftheads.heads.medusa import MedusaConfig
from draftheads.heads.mtp import MtpConfig

HIDDEN, VOCAB, LAYERS, KV_HEADS, HEAD_DIM = 64, 256, 4, 2, 16  # tests/conftest.py TINY_LLAMA
DRAFT_VOCAB = 100


def perturbed(head, seed: int = 1):
    """Random weights everywhere (zero-initialised blocks would hide a mis-mapped tensor)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return head


def make_head(base, kind: str, **overrides):
    configs = {
        "medusa": MedusaConfig(num_heads=3, num_layers=2),
        "eagle": EagleConfig(),
        # the 4-layer tiny base repeats the default (2, L//2, L-3) = (2, 2, 1): pick three layers
        "eagle3": Eagle3Config(draft_vocab_size=DRAFT_VOCAB, feature_layers=(1, 2, 3)),
        "mtp": MtpConfig(num_modules=2),
    }
    config = configs[kind] if not overrides else type(configs[kind])(**overrides)
    head = build_head(base, config, base_name="tiny-llama")
    if kind == "eagle3":  # a draft vocabulary that is not just the first N ids: d2t non-zero
        counts = torch.zeros(VOCAB)
        counts[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB]] = (
            1.0 + torch.arange(DRAFT_VOCAB)
        )
        head.init_from_data(counts)
    return perturbed(head)


def draft_outputs(head, base) -> list[torch.Tensor]:
    """What decoding consumes from a head: draft_logits (parallel) or catch_up + one draft_step."""
    input_ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden_states = base(input_ids, output_hidden_states=True).hidden_states
        features = head.select_features(hidden_states)
        if head.drafting == "parallel":
            return [head.draft_logits(features)]
        length = input_ids.shape[1] - 1
        cache = head.new_cache()
        position_ids = torch.arange(length)[None]
        hidden, logits = head.catch_up(cache, features[:, :length], input_ids[:, 1:], position_ids)
        if head.kind == "mtp":
            return [hidden, logits]
        tokens = head.draft_to_target(logits.topk(2, dim=-1).indices)  # (1, 2) two children of the root
        past = cache.get_seq_length()
        mask = torch.zeros(1, 1, 2, past + 2)
        mask[..., past:] = torch.finfo(mask.dtype).min
        mask[0, 0, torch.arange(2), past + torch.arange(2)] = 0.0  # each node sees prefix + itself
        step_hidden, step_logits = head.draft_step(
            cache, 1, hidden[:, None].expand(1, 2, -1), tokens, torch.full((1, 2), length), mask
        )
        return [hidden, logits, step_hidden, step_logits]


def assert_same_drafts(original, loaded, base):
    for expected, actual in zip(draft_outputs(original, base), draft_outputs(loaded, base)):
        assert torch.equal(expected, actual)


def strip_metadata(directory):
    """Make our export look like a checkpoint published by others: no ``draftheads`` block."""
    saved = json.loads((directory / "config.json").read_text())
    saved.pop(DRAFTHEADS_KEY)
    (directory / "config.json").write_text(json.dumps(saved))


def write_target(
    path, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS, architecture: str = "llama"
):
    """A stand-in target GGUF for the gguf writer: ``architecture``'s width and depth keys and a
    vocabulary of ``vocab`` tokens (the tiny Llama's by default)."""
    import numpy as np
    from gguf import GGUFValueType

    from draftheads.export.gguf import write_gguf_file

    fields = [
        (f"{architecture}.embedding_length", hidden, GGUFValueType.UINT32, None),
        (f"{architecture}.block_count", layers, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)], GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", [1] * vocab, GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("tokenizer.ggml.eos_token_id", 2, GGUFValueType.UINT32, None),
    ]
    write_gguf_file(path, architecture, fields, {"token_embd.weight": np.zeros((vocab, hidden), np.float32)})
    return path
