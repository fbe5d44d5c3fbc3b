"""Helpers shared by the data tests (imported by name: pytest puts this folder on sys.path).

A byte-level ChatML tokenizer (offline, no model download) and the same without a template (a
pretrained base's), the real Llama-3 chat template paired with SmolLM2's vocabulary, tiny bases
saved as directories, and small record writers.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA3_FIXTURE = FIXTURES / "llama3_chat_template"
# SmolLM2-135M-Instruct's chat template (ChatML with a default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_byte_tokenizer(chat_template: str = CHATML_TEMPLATE):
    """Byte-level BPE without merges: 256 byte tokens + <|im_start|>, <|im_end|> (vocab 258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_pretrained_byte_tokenizer():
    """The byte tokenizer as a pretrained base's, Gemma 3's in small: no chat template, and a bos
    (``<|im_start|>``) before any text it encodes, as Gemma's tokenizer puts ``<bos>``."""
    from tokenizers import processors

    tokenizer = make_byte_tokenizer(chat_template=None)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    return tokenizer


def make_tiny_gemma3_for(tokenizer, **overrides):
    """The tiny random Gemma 3 (sliding window 8) over ``tokenizer``'s vocabulary and special tokens."""
    return load_root_conftest().make_tiny_gemma3(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )


def pair_with_vocabulary(base_tokenizer, config: dict, tmp_path: Path):
    """A tokenizer directory: ``config``'s chat template and special tokens on ``base_tokenizer``'s
    vocabulary, saved and reloaded through AutoTokenizer like any downloaded tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": config["additional_special_tokens"]})
    tokenizer.bos_token, tokenizer.eos_token = config["bos_token"], config["eos_token"]
    tokenizer.chat_template = config["chat_template"]
    tokenizer.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sharegpt_record(identifier: str, *turns: tuple[str, str]) -> dict:
    return {"id": identifier, "conversations": [{"from": f, "value": v} for f, v in turns]}


def save_tiny_base(directory: Path) -> Path:
    """Write the tiny random Llama and the byte tokenizer into ``directory`` (a valid ``--base``)."""
    tokenizer = make_byte_tokenizer()
    model = load_root_conftest().make_tiny_llama(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_gemma3_base(directory: Path) -> Path:
    """Write the tiny random Gemma 3 and the pretrained byte tokenizer (no chat template) into
    ``directory`` (a valid ``--base``)."""
    tokenizer = make_pretrained_byte_tokenizer()
    make_tiny_gemma3_for(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_root_conftest():
    """tests/conftest.py as a module (for its tiny models), loaded by path under its own name."""
    spec = importlib.util.spec_from_file_location(
        "draftheads_tests_conftest", FIXTURES.parent / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
