"""Adaptive drafting: calibration, the choice of nodes to verify against the cost curve, the gate
that sits a head out, and losslessness with every drafter wrapped (greedy == generate)."""

from __future__ import annotations

import time

import pytest
import torch
from infer_stubs import gate_that_measured, greedy_reference

from draftheads.heads import EagleConfig, MedusaConfig, MtpConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.adaptive import AdaptiveDrafter, Calibration, HeadGate, prune_draft, select_nodes
from draftheads.infer.draft import Draft, Drafter
from draftheads.infer.tree import ROOT_PARENT, tree_topology
from draftheads.infer.verify_cost import CostCurve
from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

FLAT = CostCurve((1, 64), (1.0, 1.0))  # verifying costs the same at any size
STEEP = CostCurve((1, 2, 64), (1.0, 3.0, 100.0))  # a second token triples the cost
# 0 -> 1 -> 3, 0 -> 2; node 3 claims more than its parent: it counts as its parent's 0.5
PARENTS = [ROOT_PARENT, 0, 0, 1]


def test_select_nodes_weighs_expected_tokens_against_cost():
    assert select_nodes(PARENTS, [1.0, 0.5, 0.2, 0.9], FLAT.relative) == [0, 1, 2, 3]
    assert select_nodes(PARENTS, [1.0, 0.5, 0.2, 0.9], STEEP.relative) == [0]  # nothing pays: root alone
    linear = CostCurve((1, 2, 3, 4), (1.0, 1.3, 1.6, 1.9)).relative
    # sizes 2 / 3 / 4: (1.5) / 1.3, (2.0) / 1.6 = 1.25, (2.2) / 1.9: three nodes win
    assert select_nodes(PARENTS, [1.0, 0.5, 0.2, 0.9], linear) == [0, 1, 3]
    # padded sizes are what is paid for: with padding to 4 every tree up to 4 costs the same
    assert select_nodes(PARENTS, [1.0, 0.5, 0.2, 0.9], linear, pad_to_multiple=4) == [0, 1, 2, 3]


def test_prune_draft_keeps_a_closed_subtree():
    draft = Draft(
        torch.tensor([7, 8, 9, 10]), tree_topology(PARENTS), ("", "a", "b", "a"), (1.0, 0.5, 0.2, 0.4)
    )
    pruned = prune_draft(draft, [0, 1, 3], pad_to_multiple=4)
    assert pruned.tokens.tolist() == [7, 8, 10]
    assert pruned.topology.parents[:3] == (ROOT_PARENT, 0, 1) and pruned.topology.size == 4
    assert pruned.sources == ("", "a", "a") and pruned.scores == (1.0, 0.5, 0.4)
    assert prune_draft(draft, [0, 1, 2, 3]) is draft


def test_calibration_learns_what_the_verifier_accepts():
    calibration = Calibration(prior=2.0, decay=1.0)
    assert calibration.probability("context", 0.5) == pytest.approx(0.5)  # the prior: the score itself
    for _ in range(50):  # context nodes scored 0.5 are never accepted, head nodes scored 0.1 always
        calibration.record(("", "context", "eagle"), (1.0, 0.5, 0.1), accepted_nodes=(0, 2))
    assert calibration.probability("context", 0.5) < 0.05
    assert calibration.probability("eagle", 0.1) > 0.95
    assert calibration.probability("eagle", 0.9) == pytest.approx(0.9)  # another bin: still the prior


def test_head_gate_sits_out_a_head_that_does_not_pay_and_probes_it():
    gate = HeadGate("eagle", probe_every=5, warmup_steps=2)
    decisions = []
    for _ in range(30):
        drafts = gate.head_drafts()
        decisions.append(drafts)
        # the head takes 30% of a step and never gets a token accepted
        gate.record(drafts, 0.3 if drafts else 0.0, 1.0, head_accepted=0, tokens=1)
    assert decisions[:2] == [True, True]
    assert decisions.count(True) < 10 and True in decisions[10:]  # out, but probed now and then
    paying = HeadGate("eagle", warmup_steps=2)
    for _ in range(10):
        paying.record(paying.head_drafts(), 0.1, 1.0, head_accepted=2, tokens=3)
    assert paying.head_drafts()


def test_a_probe_that_pays_brings_the_head_back_at_once():
    """While out, a head's estimate is refreshed only by its probes, so a probe weighs what the
    steps it stands for would have: one good probe is enough to draft again."""
    gate = HeadGate("eagle", probe_every=8, warmup_steps=2)
    for _ in range(4):  # useless: out after the warm-up
        drafts = gate.head_drafts()
        gate.record(drafts, 0.3 if drafts else 0.0, 1.0, head_accepted=0, tokens=1)
    assert not gate.head_drafts()
    while not gate.head_drafts():  # sit out until the probe
        gate.record(False, 0.0, 1.0, head_accepted=0, tokens=1)
    gate.record(True, 0.3, 1.0, head_accepted=1.5, tokens=2.5)  # the probe: now it pays
    assert gate.head_drafts()


def test_head_gate_probes_within_its_budget():
    """A probe costs the share of a step the head's drafting adds: the costlier the head, the rarer
    its probes, between probe_every and max_probe_every."""
    gate = HeadGate("eagle", probe_every=8, max_probe_every=64, probe_budget=0.02, warmup_steps=2)
    for _ in range(2):
        gate.record(True, 0.6, 1.0, head_accepted=0, tokens=1)  # drafting adds 60% of a step
    assert gate.probe_interval() == 30
    decisions = []
    for _ in range(200):
        drafts = gate.head_drafts()
        decisions.append(drafts)
        gate.record(drafts, 0.6 if drafts else 0.0, 1.0, head_accepted=0, tokens=1)
    assert decisions.count(True) == 200 // 31  # one probe after every 30 steps out
    cheap = HeadGate("eagle", probe_every=8, probe_budget=0.02, warmup_steps=1)
    cheap.record(True, 0.1, 1.0, head_accepted=0, tokens=1)
    assert cheap.probe_interval() == 8


def test_the_head_gate_carries_from_one_sequence_to_the_next():
    """An untrained head is found out once: the next prompt starts from what the last one learned
    (a copy: a batch's rows do not share one)."""
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, EagleConfig())
    cost = CostCurve((1, 4, 8, 16, 32), (1.0, 1.1, 1.2, 1.4, 1.9))
    generator = SpeculativeGenerator(model, head, adaptive=True, cost=cost)
    generator.step_gate = gate_that_measured(drafting_pays=True)  # every step asks the head gate
    assert generator.new_drafter().gate.steps_with == 0
    generator.generate(torch.tensor([1, 5, 9, 2]), max_new_tokens=24)
    learned = generator.head_gate
    assert learned is not None and learned.steps_with >= learned.warmup_steps
    gate = generator.new_drafter().gate
    assert gate is not learned and (gate.steps_with, gate.accepted) == (learned.steps_with, learned.accepted)


HEAD_CONFIGS = {
    "medusa": MedusaConfig(num_heads=4, num_layers=1),
    "eagle": EagleConfig(),
    "mtp": MtpConfig(num_modules=3),
}


@pytest.mark.parametrize("kind", ["context-only", *HEAD_CONFIGS])
@pytest.mark.parametrize("context", [False, True])
def test_adaptive_drafting_greedy_matches_generate(kind, context):
    if kind == "context-only" and not context:
        pytest.skip("without a head the context drafter is the only one")
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = None if kind == "context-only" else build_head(model, HEAD_CONFIGS[kind])
    cost = CostCurve((1, 4, 8, 16, 32), (1.0, 1.1, 1.2, 1.4, 1.9))
    generator = SpeculativeGenerator(
        model, head, context=context and head is not None, adaptive=True, cost=cost
    )
    generator_measuring = SpeculativeGenerator(
        model, head, context=context and head is not None, adaptive=True
    )
    generator_in = torch.Generator().manual_seed(13)
    for _ in range(3):
        prompt = torch.randint(
            3, 256, (1, int(torch.randint(4, 24, (), generator=generator_in))), generator=generator_in
        )
        reference = greedy_reference(model, prompt, 48)
        assert generator.generate(prompt, max_new_tokens=48).sequences[0].tolist() == reference.tolist()
        assert (
            generator_measuring.generate(prompt, max_new_tokens=48).sequences[0].tolist()
            == reference.tolist()
        )
    assert generator_measuring.cost is not None and generator_measuring.cost.sizes[0] == 1
    assert generator.method.endswith("/adaptive")


class _SlowDrafter(Drafter):
    """Proposes the root and one child scored 0.6, taking ``seconds`` to do it."""

    def __init__(self, seconds: float):
        super().__init__(None)
        self.seconds = seconds

    @property
    def source(self) -> str:
        return "context"

    def propose(self, root, position, tree) -> Draft:
        time.sleep(self.seconds)
        tokens = torch.tensor([root, 7])
        return Draft(tokens, tree_topology([ROOT_PARENT, 0]), ("", "context"), (1.0, 0.6))


def test_a_node_is_weighed_against_the_drafting_already_spent():
    """Verifying 2 tokens costs 2x one here, so a node accepted 60% of the time does not pay for its
    verification alone (1.6 / 2 < 1); but once 5 verifications' worth of drafting is spent, the step
    costs 6 or 7 and the node raises tokens per second (1.6 / 7 > 1 / 6)."""
    cost = CostCurve((1, 2), (0.01, 0.02))
    assert AdaptiveDrafter(_SlowDrafter(0.0), cost).propose(3, 10, None).tokens.tolist() == [3]
    assert AdaptiveDrafter(_SlowDrafter(0.05), cost).propose(3, 10, None).tokens.tolist() == [3, 7]
