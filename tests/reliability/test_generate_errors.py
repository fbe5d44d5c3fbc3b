"""Careless ``generate`` inputs end as one line naming the argument and the value, never a
traceback: in the Python API (an exception with that line) and in ``draftheads generate`` (that
line on stderr, the exit status of its kind: 2 usage, 3 bad input, 4 head files, 5 environment)."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.base_model import load_tokenizer
from draftheads.cli import main
from draftheads.heads import EagleConfig, MedusaConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.tree import TUNED_TREE_FORMAT, DynamicTree
from tests.conftest import make_tiny_llama
from tests.reliability.generate_fixtures import VOCAB, run_generate, save_tiny_base, save_tiny_head

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def with_tokenizer(base_dir):
    """The context drafter on a tiny base with the SmolLM2 tokenizer."""
    return SpeculativeGenerator(make_tiny_llama(vocab_size=VOCAB), tokenizer=load_tokenizer(str(base_dir)))


def last_line(capsys) -> str:
    """The last stderr line (loading progress may come before it), checked for a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return last_line(capsys)


# ---- prompts and stop strings --------------------------------------------------------------------


def test_an_empty_raw_prompt_is_refused(base_dir, with_tokenizer, capsys):
    assert run_generate(main, base_dir, "--raw", "--prompt", "") == 2
    assert last_line(capsys) == (
        "draftheads generate: --raw --prompt '' is empty: give the text the model should continue"
    )
    with pytest.raises(ValueError, match="^prompt: the prompt is empty"):
        with_tokenizer.generate("", max_new_tokens=2)


def test_an_empty_stop_string_is_refused(base_dir, with_tokenizer, capsys):
    line = usage_error(capsys, ["generate", "--base", str(base_dir), "--prompt", "p", "--stop", ""])
    assert line.endswith("argument --stop: must not be empty")
    with pytest.raises(ValueError, match="stop strings must be non-empty strings, got ''"):
        with_tokenizer.generate("hello", max_new_tokens=2, stop=["end", ""])


def test_a_chat_message_without_content_is_named(with_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    with pytest.raises(ValueError, match=r"^prompt: message 1 \{'role': 'user'\} has no 'content'"):
        with_tokenizer.generate(messages, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt 1: message 0 \{'content': 'hi'\} has no 'role'"):
        with_tokenizer.generate([[{"role": "user", "content": "hi"}], [{"content": "hi"}]], max_new_tokens=2)


# ---- sampling arguments --------------------------------------------------------------------------


def test_a_temperature_below_1e_5_decodes_greedily(base_dir, with_tokenizer, capsys):
    greedy = with_tokenizer.generate("hello", max_new_tokens=4)
    tiny = with_tokenizer.generate("hello", max_new_tokens=4, temperature=1e-40, seed=0)
    assert tiny.new_tokens == greedy.new_tokens
    assert run_generate(main, base_dir, "--raw", "--prompt", "hello") == 0
    greedy_out = capsys.readouterr().out
    assert run_generate(main, base_dir, "--raw", "--prompt", "hello", "--temperature", "1e-40") == 0
    assert capsys.readouterr().out == greedy_out


@pytest.mark.parametrize(
    "argument, value, message",
    [
        ("top_k", 2.5, "top_k must be an integer, got 2.5 (float)"),
        ("top_k", True, "top_k must be an integer, got True (bool)"),
        ("temperature", "0.5", "temperature must be a number, got '0.5' (str)"),
        ("top_p", None, "top_p must be a number, got None (NoneType)"),
    ],
)
def test_a_sampling_argument_of_the_wrong_type_is_named(with_tokenizer, argument, value, message):
    with pytest.raises(TypeError) as error:
        with_tokenizer.generate("hello", max_new_tokens=2, **{argument: value})
    assert str(error.value) == message


# ---- devices ---------------------------------------------------------------------------------------


def test_an_unusable_device_is_refused(base_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_generate(main, base_dir, "--prompt", "hi", "--device", "cuda") == 5
    assert last_line(capsys) == (
        "draftheads generate: device 'cuda' is not available: this torch "
        f"({torch.__version__}) sees no CUDA device; use --device cpu"
    )
    with pytest.raises(RuntimeError, match="device 'cuda:1' is not available"):
        SpeculativeGenerator.from_pretrained(None, base=str(base_dir), device="cuda:1", pack=False)


# ---- trees -----------------------------------------------------------------------------------------


def write_tuned_tree(head_dir, tree: dict) -> None:
    saved = {"format": TUNED_TREE_FORMAT, "trees": {"cpu/float32": {"tree": tree}}}
    (head_dir / "tree.json").write_text(json.dumps(saved))


def test_a_static_tree_rank_beyond_the_vocabulary_is_refused(base_dir, tmp_path, capsys):
    head_dir = save_tiny_head(base_dir, MedusaConfig(num_heads=2, num_layers=1), tmp_path / "head")
    write_tuned_tree(head_dir, {"type": "static", "name": "wide", "choices": [[0], [VOCAB], [0, 0]]})
    assert run_generate(main, base_dir, "--heads", str(head_dir), "--prompt", "hi") == 4
    assert last_line(capsys) == (
        f"draftheads generate: {head_dir / 'tree.json'}: trees.cpu/float32.tree: tree 'wide': path "
        f"[{VOCAB}] asks for candidate {VOCAB} but the head drafts from {VOCAB} tokens (ranks 0..{VOCAB - 1})"
    )
    model = make_tiny_llama()
    head = build_head(model, MedusaConfig(num_heads=2, num_layers=1))
    with pytest.raises(ValueError, match=r"path \[0, 300\] asks for candidate 300 .* from 256 tokens"):
        SpeculativeGenerator(model, head, tree=[[0], [0, 300]])


def test_a_dynamic_tree_wider_than_the_vocabulary_is_refused(base_dir, tmp_path, capsys):
    head_dir = save_tiny_head(base_dir, EagleConfig(), tmp_path / "head")
    write_tuned_tree(head_dir, {"type": "dynamic", "top_k": 100000, "depth": 6, "total_tokens": 60})
    assert run_generate(main, base_dir, "--heads", str(head_dir), "--prompt", "hi") == 4
    assert last_line(capsys).endswith(
        f"tree.json: trees.cpu/float32.tree: dynamic tree 'tuned': top_k 100000 exceeds the head's "
        f"draft vocabulary of {VOCAB} tokens"
    )
    model = make_tiny_llama()
    head = build_head(model, EagleConfig())
    with pytest.raises(ValueError, match="top_k 100000 exceeds the head's draft vocabulary of 256 tokens"):
        SpeculativeGenerator(model, head, tree=DynamicTree("huge", top_k=100000, depth=6, total_tokens=60))


def test_a_dynamic_tree_that_would_not_fit_in_memory_is_refused(monkeypatch):
    monkeypatch.setattr("draftheads.infer.limits.available_memory", lambda device: 2_000_000)
    model = make_tiny_llama()
    head = build_head(model, EagleConfig())
    with pytest.raises(
        ValueError,
        match=r"top_k 200 needs about [\d.]+ MiB .* 1.9 MiB is free on cpu: at most top_k \d+ fits",
    ):
        SpeculativeGenerator(model, head, tree=DynamicTree("wide", top_k=200, depth=6, total_tokens=60))
    SpeculativeGenerator(model, head, tree=DynamicTree("narrow", top_k=10, depth=6, total_tokens=60))
