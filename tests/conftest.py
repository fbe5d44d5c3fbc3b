"""Shared fixtures: a tiny random Llama (and Gemma 3) for unit tests, the real SmolLM2 for
integration tests."""

from __future__ import annotations

import os

import pytest
import torch

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def make_tiny_llama(seed: int = 0, **overrides):
    """A 4-layer random Llama (fp32, sdpa, eval mode, frozen): fast enough for every unit test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


# Gemma 3's geometry in small: grouped queries, head_dim apart from hidden / heads, scores scaled by
# query_pre_attn_scalar (not head_dim), tied embeddings, and sliding-window layers (a window of 8,
# shorter than the test prompts) beside a full-attention one.
TINY_GEMMA3 = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "query_pre_attn_scalar": 12,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def make_tiny_gemma3(seed: int = 0, **overrides):
    """A 4-layer random Gemma 3 text model (fp32, sdpa, eval mode, frozen)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(**{**TINY_GEMMA3, **overrides}, attn_implementation="sdpa")
    model = Gemma3ForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture
def single_thread():
    """One intra-op thread around a test, whatever an earlier test left set (every test starts with
    one already: see ``pytest_configure``). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in fp32 (converted once into DRAFTHEADS_CACHE)."""
    from draftheads.base_model import load_base

    model, tokenizer = load_base("smollm2-135m-instruct", dtype="float32")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from draftheads.base_model import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def pytest_configure(config):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One intra-op thread in this process and in the processes tests launch: tiny models are
    # dominated by per-op overhead, and on a shared 2-core machine two spinning OpenMP threads make
    # a test ~10x slower (the suite's model tests take seconds, not minutes, with one).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # pytest-xdist workers would each convert the embedded SmolLM2 on first use, and the second
        # rename of a converted directory onto the first fails: convert it once before they start.
        from draftheads.base_model import resolve_base_path

        resolve_base_path("smollm2-135m-instruct")
