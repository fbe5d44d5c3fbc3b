"""Tiny base models on disk for the ``draftheads generate`` reliability tests: a random 4-layer Llama
with the embedded SmolLM2 tokenizer (49152 ids), so text, chat templates and stop strings work,
loadable with ``--base <dir>`` like any local model."""

from __future__ import annotations

from pathlib import Path

from draftheads.base_model import load_tokenizer
from draftheads.heads import build_head
from tests.conftest import make_tiny_llama

TOKENIZER = "smollm2-135m-instruct"
VOCAB = 49152  # the tokenizer's


def save_tiny_base(directory: Path, **overrides) -> Path:
    """A tiny random base model and the SmolLM2 tokenizer saved in ``directory``."""
    model = make_tiny_llama(vocab_size=VOCAB, **overrides)
    model.save_pretrained(directory)
    load_tokenizer(TOKENIZER).save_pretrained(directory)
    return directory


def save_tiny_head(base_dir: Path, config, directory: Path) -> Path:
    """A head of ``config`` built on the base saved in ``base_dir``, saved in ``directory``."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    return build_head(base, config, base_name=str(base_dir)).save_pretrained(directory)


def run_generate(main, base_dir: Path, *arguments: str) -> int:
    """``draftheads generate --base base_dir ...`` for 3 new tokens, with nothing measured first (no
    adaptive drafting, default kernels); later ``arguments`` win."""
    options = ["--no-adaptive", "--no-pack", "--max-new-tokens", "3"]
    return main(["generate", "--base", str(base_dir), *options, *arguments])
