"""The step gate: decoding steps draft only while drafting emits more tokens per second than plain
steps, measured per batch size, with the other kind of step probed now and then."""

from __future__ import annotations

import pytest
import torch
from infer_stubs import gate_that_measured, greedy_reference

from draftheads.heads import EagleConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.cost import CostCurve
from draftheads.infer.step_gate import StepGate
from tests.conftest import make_tiny_llama


def _run(gate: StepGate, batch: int, steps: int, drafting_rate, plain_rate=lambda step: 10.0) -> list[bool]:
    """Drive ``gate`` for ``steps`` steps where a drafting step emits drafting_rate(step) tokens per
    second and a plain one plain_rate(step); the decisions."""
    decisions = []
    for step in range(steps):
        drafted = gate.drafts(batch)
        decisions.append(drafted)
        rate = drafting_rate(step) if drafted else plain_rate(step)
        gate.record(batch, drafted, tokens=batch, seconds=batch / rate)
    return decisions


def test_the_gate_keeps_plain_steps_when_drafting_is_slower_and_probes_it():
    gate = StepGate(probe_every=5, warmup_steps=2, probe_budget=1.0)
    decisions = _run(gate, 4, 40, drafting_rate=lambda step: 7.0)
    assert decisions[:4] == [True, True, False, False]  # warm-up: each kind measured
    later = decisions[4:]
    assert later.count(True) == len(later) // 6  # one probe after every 5 plain steps
    assert "batch 4: drafting 7.0 tokens/s over" in gate.summary()


def test_the_gate_keeps_drafting_when_it_pays():
    gate = StepGate(probe_every=5, warmup_steps=2, probe_budget=1.0)
    decisions = _run(gate, 1, 40, drafting_rate=lambda step: 14.0)
    assert decisions[4:].count(False) == len(decisions[4:]) // 6


def test_the_gate_follows_a_change_through_its_probes():
    gate = StepGate(probe_every=4, warmup_steps=2, probe_budget=1.0)
    decisions = _run(gate, 2, 80, drafting_rate=lambda step: 6.0 if step < 40 else 20.0)
    assert decisions[20:40].count(True) <= 4
    assert decisions[70:].count(True) >= 8  # a few probes moved the average past the plain rate


def test_probes_of_a_much_slower_kind_are_rarer():
    """A probe of a kind r times slower costs r - 1 steps: the interval keeps probes within the
    budget, between probe_every and max_probe_every."""
    gate = StepGate(probe_every=8, max_probe_every=64, probe_budget=0.02)
    assert gate.probe_interval(1.05) == 8
    assert gate.probe_interval(1.5) == 25
    assert gate.probe_interval(3.0) == 64 and gate.probe_interval(float("inf")) == 64
    decisions = _run(gate, 4, 200, drafting_rate=lambda step: 5.0)  # half the plain rate
    assert decisions[6:].count(True) == 3  # one probe per 51 steps


def test_each_batch_size_has_its_own_measurements():
    gate = StepGate(probe_every=3, warmup_steps=2, probe_budget=1.0)
    _run(gate, 16, 30, drafting_rate=lambda step: 5.0)
    _run(gate, 1, 30, drafting_rate=lambda step: 15.0)
    assert gate.since_probe[16] < 3 and gate.since_probe[1] < 3
    gate.since_probe.update({16: 0, 1: 0})
    assert not gate.drafts(16) and gate.drafts(1)


def test_a_new_batch_size_follows_the_nearest_measured_one_until_it_has_its_own():
    gate = StepGate(probe_every=8, max_probe_every=8, warmup_steps=2)
    assert gate.drafts(12)  # nothing measured: the warm-up drafts first
    _run(gate, 16, 10, drafting_rate=lambda step: 5.0)
    assert not gate.drafts(12) and not gate.drafts(1)  # nearest measured: 16, where plain steps won
    decisions = _run(gate, 15, 40, drafting_rate=lambda step: 30.0)  # but at 15 drafting pays
    assert not any(decisions[:8])  # no warm-up: 16's choice until the first probe
    assert decisions[-10:].count(True) >= 8  # two probes later 15 has both kinds measured: it drafts
    assert gate.drafts(14)  # and 14 now follows 15


def test_a_step_cannot_take_negative_time():
    with pytest.raises(ValueError, match="seconds >= 0"):
        StepGate().record(1, True, tokens=2, seconds=-1.0)


def test_a_generator_whose_gate_finds_drafting_slower_decodes_plainly_and_losslessly():
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, EagleConfig())
    cost = CostCurve((1, 4, 8, 16), (1.0, 1.05, 1.1, 1.2))  # verifying trees looks almost free
    prompt = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    reference = greedy_reference(model, prompt, 40)
    for drafting_pays in (False, True):
        generator = SpeculativeGenerator(model, head, context=True, adaptive=True, cost=cost)
        generator.step_gate = gate_that_measured(drafting_pays)
        result = generator.generate(prompt, max_new_tokens=40)
        assert result.sequences[0].tolist() == reference.tolist()
        proposed = sum(result.stats.proposed_by_source.values())
        if drafting_pays:
            assert proposed > 0
        else:  # every step verified its root alone: plain decoding
            assert proposed == 0 and result.stats.verification_steps == 39


def test_the_generator_weighs_a_drafting_step_by_its_expected_tokens():
    """A drafting step counts 1 + the calibrated path probabilities of its nodes (what adaptive
    drafting expected of it), a plain step its one token: what the gate compares is not the noise of
    how many tokens one step happened to accept."""
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, EagleConfig())
    cost = CostCurve((1, 4, 8, 16), (1.0, 1.05, 1.1, 1.2))
    generator = SpeculativeGenerator(model, head, context=True, adaptive=True, cost=cost)
    generator.step_gate = gate_that_measured(drafting_pays=True)
    recorded = []
    record = generator.step_gate.record

    def spy(batch, drafted, tokens, seconds):
        recorded.append((drafted, tokens))
        record(batch, drafted, tokens, seconds)

    generator.step_gate.record = spy
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(5))
    result = generator.generate(prompt, max_new_tokens=30)
    drafted = [tokens for did, tokens in recorded if did]
    assert drafted and all(tokens >= 1.0 for tokens in drafted)
    assert any(tokens != int(tokens) for tokens in drafted)  # expected, not counted
    assert sum(drafted) != result.stats.new_tokens - 1  # not the tokens the steps emitted
