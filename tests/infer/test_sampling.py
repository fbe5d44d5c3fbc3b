"""Sampling is lossless: speculative samples follow the base model's distribution.

On a tiny model (vocab 16), the joint distribution of the first two generated tokens is computed
exactly with transformers' own logits warpers and compared with speculative samples by a
chi-square test. A drafter that proposes the base model's own best tokens makes both acceptances
and rejections frequent. The same test must fail against a verifier with a classic bug (it forgets
to remove a rejected token before resampling): the negative control stays in the suite so the test
keeps its power.
"""

from __future__ import annotations

import pytest
import torch
from infer_stubs import SelfDraftStub, gate_that_measured
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import draftheads.infer.generate as generate_module
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.tree import DynamicTree
from draftheads.infer.verify import Acceptance, sample_token, target_probabilities
from draftheads.infer.verify_cost import CostCurve
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 16
PROMPT = [1, 5, 7, 9]
SAMPLES = 400  # p-values measured here: 0.04-0.9 for exact verifiers
CONTROL_SAMPLES = 600  # the negative control gives p ~ 1e-19 at 600 (~1e-5 at 300)
TREE = DynamicTree("sampling-test", top_k=3, depth=3, total_tokens=8)


def sampling_model():
    """A tiny model with a 16-token vocabulary whose next-token distributions are sharp enough that
    acceptance and truncation (top-k/top-p) matter."""
    model = make_tiny_llama(
        seed=2,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    # A random init gives near-uniform next-token distributions; sharpen them so that acceptance
    # and truncation (top-k/top-p) matter.
    model.lm_head.weight.data *= 8
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def model():
    return sampling_model()


def exact_first_two(model, temperature: float, top_k: int, top_p: float, prompt=PROMPT) -> torch.Tensor:
    """(V, V) probability of the first two tokens, from transformers' warpers (not ours)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    prompt = torch.tensor([prompt])
    with torch.no_grad():
        first = torch.softmax(warpers(prompt, model(prompt).logits[:, -1].float()), dim=-1)[0]  # (V,)
        continued = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # (V, T+1)
        second = torch.softmax(warpers(continued, model(continued).logits[:, -1].float()), dim=-1)  # (V, V)
    return first[:, None] * second


def speculative_first_two(
    model,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    samples: int = SAMPLES,
    drafting: str = "head",
    prompt=PROMPT,
) -> tuple[torch.Tensor, float]:
    """(V, V) counts of the first two tokens over ``samples`` speculative generations, and tau.
    ``drafting``: "head" (a stub drafting the base's own best tokens), "context", "hybrid" or
    "adaptive-hybrid" (its trees pruned by adaptive drafting)."""
    if drafting == "context":
        generator = SpeculativeGenerator(model, None)
    else:
        head = SelfDraftStub(model, first_token=prompt[0])
        adaptive = drafting == "adaptive-hybrid"
        cost = CostCurve((1, 4, 8, 16), (1.0, 1.3, 1.6, 2.2)) if adaptive else None  # pruning bites
        generator = SpeculativeGenerator(
            model, head, tree=TREE, context=drafting != "head", adaptive=adaptive, cost=cost
        )
        generator.step_gate = gate_that_measured(drafting_pays=True)  # draft whatever the wall-clock says
    counts = torch.zeros(VOCAB, VOCAB)
    emitted = steps = 0
    for sample in range(samples):
        result = generator.generate(
            prompt, max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + sample
        )
        first, second = result.new_tokens
        counts[first, second] += 1
        emitted += result.stats.tau * result.stats.verification_steps
        steps += result.stats.verification_steps
    return counts, emitted / steps


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 samples are pooled into one."""
    expected = probabilities.flatten().double() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    observed = torch.cat([observed[~small], observed[small].sum()[None]])
    return float(
        chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    )


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
def test_sampling_matches_base_distribution(model, temperature, top_k, top_p):
    counts, tau = speculative_first_two(model, temperature, top_k, top_p, seed=1000)
    assert tau > 1.5, "the drafter must get tokens accepted for this test to mean anything"
    assert chi_square_p_value(counts, exact_first_two(model, temperature, top_k, top_p)) > 1e-3


@pytest.fixture(scope="module")
def repeating_prompt(model) -> list[int]:
    """The model's own greedy text, then its start again: what comes next is in the context, so the
    context drafter proposes likely tokens and acceptances and rejections are both frequent."""
    text = model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0].tolist()
    return text + text[1:4]


@pytest.mark.parametrize("drafting", ["context", "hybrid", "adaptive-hybrid"])
def test_sampling_through_context_and_hybrid_trees_matches_base_distribution(
    model, repeating_prompt, drafting
):
    counts, tau = speculative_first_two(
        model, 1.0, 0, 1.0, seed=2000, drafting=drafting, prompt=repeating_prompt
    )
    assert tau > 1.2, "drafts must get accepted for this test to mean anything"
    assert chi_square_p_value(counts, exact_first_two(model, 1.0, 0, 1.0, repeating_prompt)) > 1e-3


def forgetful_verifier(logits, tokens, topology, params, generator=None):
    """The bug the negative control plants: a rejected token stays in p, so rejection sampling
    resamples from the full distribution and over-weights proposed tokens."""
    node_tokens = tokens.tolist()
    node, accepted = 0, [0]
    while True:
        probabilities = target_probabilities(logits[node].cpu(), params)
        chosen = None
        for child in topology.children[node]:
            if float(torch.rand((), generator=generator)) < float(probabilities[node_tokens[child]]):
                chosen = child
                break
        if chosen is None:
            return Acceptance(tuple(accepted), sample_token(probabilities, generator))
        accepted.append(chosen)
        node = chosen


def test_negative_control_biased_verifier_fails(model, monkeypatch):
    monkeypatch.setattr(generate_module, "verify_tree", forgetful_verifier)
    counts, _ = speculative_first_two(model, 1.0, 0, 1.0, seed=1000, samples=CONTROL_SAMPLES)
    assert chi_square_p_value(counts, exact_first_two(model, 1.0, 0, 1.0)) < 1e-6


def test_negative_control_biased_verifier_fails_on_context_trees(model, repeating_prompt, monkeypatch):
    monkeypatch.setattr(generate_module, "verify_tree", forgetful_verifier)
    counts, _ = speculative_first_two(
        model, 1.0, 0, 1.0, seed=2000, samples=CONTROL_SAMPLES, drafting="context", prompt=repeating_prompt
    )
    assert chi_square_p_value(counts, exact_first_two(model, 1.0, 0, 1.0, repeating_prompt)) < 1e-6
