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
    gate = StepGate(probe_every=5, warmup_steps=2)
    decisions = _run(gate, 4, 40, drafting_rate=lambda step: 7.0)
    assert decisions[:4] == [True, True, False, False]  # warm-up: each kind measured
    later = decisions[4:]
    assert later.count(True) == len(later) // 6  # one probe after every 5 plain steps
    assert "batch 4: drafting 7.0 tokens/s over" in gate.summary()


def test_the_gate_keeps_drafting_when_it_pays():
    gate = StepGate(probe_every=5, warmup_steps=2)
    decisions = _run(gate, 1, 40, drafting_rate=lambda step: 14.0)
    assert decisions[4:].count(False) == len(decisions[4:]) // 6


def test_the_gate_follows_a_change_through_its_probes():
    gate = StepGate(probe_every=4, warmup_steps=2)
    decisions = _run(gate, 2, 80, drafting_rate=lambda step: 6.0 if step < 40 else 20.0)
    assert decisions[20:40].count(True) <= 4
    assert decisions[70:].count(True) >= 8  # a few probes moved the average past the plain rate


def test_each_batch_size_has_its_own_measurements():
    gate = StepGate(probe_every=100, warmup_steps=2)
    _run(gate, 16, 10, drafting_rate=lambda step: 5.0)
    _run(gate, 1, 10, drafting_rate=lambda step: 15.0)
    assert not gate.drafts(16) and gate.drafts(1)
    assert gate.drafts(8)  # never measured: warm-up drafts first


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
