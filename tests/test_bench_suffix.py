"""Suffix drafting in bench: its methods, and a history that never holds the answer of the prompt
being decoded (the warm-up and the repeats decode each prompt more than once)."""

from types import SimpleNamespace

import torch

from draftheads.bench import BenchPrompt, HFMethod, SpeculativeMethod, run_bench, speculative_methods
from draftheads.heads import build_head
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.suffix import SuffixTree


def spied(method: SpeculativeMethod) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Record, at every ``generate`` call of the method's generator, the prompts it decodes and the
    answers in its history then."""
    generator, calls = method.generator, []
    original = generator.generate

    def generate(prompts, **kwargs):
        calls.append(
            ([p.flatten().tolist() for p in prompts], [a.tolist() for a in generator.history.answers])
        )
        return original(prompts, **kwargs)

    generator.generate = generate
    return calls


def test_a_run_drafts_only_from_earlier_answers_of_other_prompts(tiny_llama):
    method = SpeculativeMethod("suffix", SpeculativeGenerator(tiny_llama, None, tree=SuffixTree()))
    calls = spied(method)
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, 10))) for i in range(3)]
    samples = run_bench([method], prompts, max_new_tokens=20, temperature=0.0, repeats=2, progress=False)
    answers = [s.tokens for s in samples]
    assert len(calls) == 1 + 3 * 2  # the warm-up, then two repeats of each prompt
    expected = [[], [], [], [answers[0]], [answers[0]], answers[:2], answers[:2]]
    assert [history for _, history in calls] == expected
    # a second pass (as for the next batch size) starts from no answers: not the first pass's
    calls.clear()
    run_bench([method], prompts, max_new_tokens=20, temperature=0.0, progress=False)
    assert [history for _, history in calls][1:3] == [[], [answers[0]]]


def test_a_continuous_run_starts_from_no_answers(tiny_llama):
    method = SpeculativeMethod("suffix", SpeculativeGenerator(tiny_llama, None, tree=SuffixTree()))
    calls = spied(method)
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, 10))) for i in range(3)]
    run_bench([method], prompts, 20, 0.0, repeats=2, batch_size=2, continuous=True, progress=False)
    assert [history for _, history in calls] == [[], [], []]  # every prompt is in every run


def test_suffix_methods_are_built_alone_and_merged(tmp_path, tiny_llama):
    head_dir = tmp_path / "medusa-run"
    build_head(tiny_llama, MedusaConfig(num_heads=2)).save_pretrained(head_dir)
    methods = speculative_methods(
        [str(head_dir)], tiny_llama, None, "cpu-8", "cpu", suffix=True, adaptive=True
    )
    assert [m.name for m in methods] == [
        "suffix",
        "suffix/adaptive",
        "medusa:medusa-run",
        "medusa/adaptive:medusa-run",
        "medusa+suffix:medusa-run",
        "medusa+suffix/adaptive:medusa-run",
    ]
    plain = HFMethod("generate", tiny_llama, SimpleNamespace(pad_token_id=0))
    torch.manual_seed(0)
    prompts = [BenchPrompt(str(i), "x", torch.randint(3, 256, (1, 12))) for i in range(2)]
    samples = run_bench([plain, *methods], prompts, max_new_tokens=16, temperature=0.0, progress=False)
    assert all(s.agrees for s in samples)
