"""Shared by the head tests: one small config per kind, a batch, base hidden states.

Imported by name (pytest puts this folder on sys.path, under ``pytest`` and ``python -m pytest``
alike). Not a conftest.py: a second module named ``conftest`` would shadow the root one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from draftheads.heads import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig, PEagleConfig

# The tiny Llama has 4 layers, so EAGLE-3's default (2, L//2, L-3) = (2, 2, 1) would repeat a layer.
HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=3, num_layers=2),
    "eagle": EagleConfig(),
    "eagle3": Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3),
    "mtp": MtpConfig(num_modules=3),
    "peagle": PEagleConfig(feature_layers=(1, 2, 3), draft_vocab_size=64, ttt_steps=3),
}
KINDS = tuple(HEAD_CONFIGS)
AUTOREGRESSIVE_KINDS = ("eagle", "eagle3", "mtp")


def _load_root_conftest():
    """tests/conftest.py loaded by path under its own name (for make_tiny_llama, TINY_LLAMA)."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("draftheads_heads_root_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = _load_root_conftest()
make_tiny_llama = _ROOT.make_tiny_llama
TINY_LLAMA = _ROOT.TINY_LLAMA


def base_hidden_states(model, input_ids, attention_mask=None):
    with torch.no_grad():
        return model.model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states


def move_norms_off_unit_weight(head, seed: int) -> None:
    """Add U(0, 1) to every norm weight of ``head``: at unit weight an RMSNorm applied twice equals
    one, so a test of where a norm applies would pass either way."""
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if "norm" in name:
                parameter.add_(torch.rand(parameter.shape, generator=torch.Generator().manual_seed(seed)))


def token_counts(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(input_ids.flatten(), minlength=vocab_size)


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (2, 16), generator=generator)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :4] = 0  # a "prompt" that is not supervised
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 13:] = 0  # right padding in the second row
    loss_mask[1, 13:] = 0
    return input_ids, loss_mask, attention_mask
