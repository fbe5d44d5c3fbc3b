"""Data-test fixtures: the byte tokenizer, a tiny base model directory using it, the Llama-3
chat template on SmolLM2's vocabulary (see data_fixtures.py), and Gemma 3's tokenizer."""

from __future__ import annotations

import json

import pytest
from data_fixtures import LLAMA3_FIXTURE, make_byte_tokenizer, pair_with_vocabulary, save_tiny_base


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """A directory holding the tiny random Llama and the byte tokenizer: a valid ``--base``."""
    return save_tiny_base(tmp_path_factory.mktemp("tiny_base"))


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    """The embedded Gemma 3 270M tokenizer (a pretrained base: no chat template)."""
    from draftheads.base_model import load_tokenizer

    return load_tokenizer("gemma3-270m")


@pytest.fixture(scope="session")
def llama3_config():
    return json.loads((LLAMA3_FIXTURE / "tokenizer_config.json").read_text())


@pytest.fixture(scope="session")
def llama3_tokenizer(smollm2_tokenizer, llama3_config, tmp_path_factory):
    return pair_with_vocabulary(smollm2_tokenizer, llama3_config, tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def llama3_generation_tokenizer(smollm2_tokenizer, llama3_config, tmp_path_factory):
    variant = dict(
        llama3_config, chat_template=(LLAMA3_FIXTURE / "generation_variant.jinja").read_text().rstrip("\n")
    )
    return pair_with_vocabulary(smollm2_tokenizer, variant, tmp_path_factory.mktemp("llama3_generation"))
