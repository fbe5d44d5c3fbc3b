"""Every generated row says why it ended: ``length`` (max_new_tokens), ``stop`` (a stop string or
stop token id), ``eos`` (an end-of-sequence token) or ``context`` (the base model's context is
full), in the API's results, their stats, a batch's stats, a stream, and ``draftheads generate``."""

from __future__ import annotations

import pytest
import torch

from draftheads.base_model import load_tokenizer
from draftheads.cli import main
from draftheads.infer import SpeculativeGenerator
from tests.conftest import make_tiny_llama
from tests.reliability.generate_fixtures import run_generate, save_tiny_base

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 9, 14, 3, 77, 41, 8, 120, 16, 33]  # 10 tokens


def generator(context: int = 512) -> SpeculativeGenerator:
    """The context drafter on a tiny Llama whose context is ``context`` positions, with no EOS."""
    model = make_tiny_llama(max_position_embeddings=context)
    model.generation_config.eos_token_id = None
    return SpeculativeGenerator(model)


def test_max_new_tokens_ends_a_row_with_length():
    result = generator().generate(PROMPT, max_new_tokens=4)
    assert len(result.new_tokens) == 4
    assert result.finish_reason == "length" and result.stats.finish_reason == "length"


def test_the_context_limit_ends_a_row_with_context():
    result = generator(context=16).generate(PROMPT, max_new_tokens=50)
    assert result.sequences.shape[1] == 16  # 6 new tokens fill the 16 positions
    assert result.finish_reason == "context"
    assert "context" in result.stats.summary()


def test_an_eos_token_ends_a_row_with_eos_and_a_stop_token_with_stop():
    plain = generator()
    second = plain.generate(PROMPT, max_new_tokens=2).new_tokens[-1]
    stopped = plain.generate(PROMPT, max_new_tokens=8, stop_token_ids=[second])
    assert stopped.new_tokens[-1] == second and stopped.finish_reason == "stop"
    ending = generator()
    ending.eos_ids = frozenset({second})
    result = ending.generate(PROMPT, max_new_tokens=8)
    assert result.new_tokens[-1] == second and result.finish_reason == "eos"


def test_a_batch_and_a_stream_report_each_row():
    rows = [PROMPT, PROMPT[:4]]
    result = generator(context=16).generate(rows, max_new_tokens=10)
    assert [r.finish_reason for r in result.results] == ["context", "length"]
    assert result.finish_reasons == ["context", "length"]
    assert result.stats.finish_reasons == {"context": 1, "length": 1}


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    """A tiny base with the SmolLM2 tokenizer whose context is 24 positions."""
    return save_tiny_base(tmp_path_factory.mktemp("base"), max_position_embeddings=24)


def test_a_stream_reports_each_row_as_it_ends(small_base):
    model = make_tiny_llama(vocab_size=49152, max_position_embeddings=24)
    tokenizer = load_tokenizer(str(small_base))
    plain = SpeculativeGenerator(model, tokenizer=tokenizer)
    prompts = [torch.tensor(PROMPT), torch.tensor(PROMPT[:4])]
    stream = plain.generate(prompts, max_new_tokens=16, stream=True, batch_size=1)
    seen = {}
    for row, _ in stream:
        seen.update(stream.finish_reasons)
    assert seen == stream.finish_reasons == {0: "context", 1: "length"}
    assert stream.result.finish_reasons == ["context", "length"]


def test_generate_prints_each_rows_finish_reason(small_base, capsys):
    assert run_generate(main, small_base, "--raw", "--prompt", "hello") == 0
    assert "finish reason: length" in capsys.readouterr().err
    arguments = ["--raw", "--prompt", "hi", "--prompt", "yo", "--max-new-tokens", "99"]
    assert run_generate(main, small_base, *arguments) == 0
    err = capsys.readouterr().err
    assert "[prompt 0]" in err and err.count("finish reason: context") == 2, err
    assert "the base model's context (24 positions) is full" in err
