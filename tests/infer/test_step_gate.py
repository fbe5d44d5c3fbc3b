"""The step gate: decoding steps draft only while drafting emits more tokens per second than plain
steps, measured per batch size, with the other kind of step probed now and then."""

from __future__ import annotations

import pytest
import torch
from infer_stubs import gate_that_measured, greedy_reference

from draftheads.heads import EagleConfig, build_head
from draftheads.infer import SpeculativeGenerator
from draftheads.infer.step_gate import StepGate
from draftheads.infer.verify_cost import CostCurve
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
    gate = StepGate(probe_every=8, max_probe_every=64, probe_budget=0.02, warmup_steps=3)
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


def test_a_new_batch_size_follows_a_near_measured_one_until_it_has_its_own():
    gate = StepGate(probe_every=8, max_probe_every=8, warmup_steps=2)
    assert gate.drafts(12)  # nothing measured: the warm-up drafts first
    _run(gate, 16, 10, drafting_rate=lambda step: 5.0)
    assert not gate.drafts(12)  # 16, within a factor of 2, found plain steps faster
    assert gate.drafts(1)  # 16 says nothing safe about 1 row: 1 warms up, drafting first
    decisions = _run(gate, 15, 40, drafting_rate=lambda step: 30.0)  # but at 15 drafting pays
    assert not any(decisions[:8])  # no warm-up: 16's choice until the first probe
    assert decisions[-10:].count(True) >= 8  # two probes later 15 has both kinds measured: it drafts
    assert gate.drafts(14)  # and 14 now follows 15


def test_drafting_that_lost_with_fewer_rows_loses_with_more_and_won_with_more_wins_with_fewer():
    """Verification costs relatively more the bigger the batch, so only those two conclusions
    carry over to a batch size however far; drafting that won with one row is measured again
    with four."""
    gate = StepGate(probe_every=8, warmup_steps=2)
    _run(gate, 4, 10, drafting_rate=lambda step: 5.0)  # lost with 4 rows
    assert not gate.drafts(16) and not gate.drafts(64)
    _run(gate, 1, 10, drafting_rate=lambda step: 30.0)  # won with 1 row
    assert gate.drafts(1)
    assert not gate.drafts(3)  # within a factor of 2 of 4, which lost; 1 says nothing about more
    fresh = StepGate(probe_every=8, warmup_steps=2)
    _run(fresh, 1, 10, drafting_rate=lambda step: 30.0)
    assert fresh._decision(4) is None  # measured at 4 from its own warm-up
    _run(fresh, 32, 10, drafting_rate=lambda step: 30.0)  # won with 32 rows
    assert fresh._decision(4) == fresh._compare(32)


def test_the_gate_scales_expected_tokens_by_what_drafting_steps_emitted():
    gate = StepGate(probe_every=8, warmup_steps=2, correction_prior=0.0, correction_decay=1.0)
    for _ in range(20):  # drafting expected 2.4 tokens per step at 20 steps/s, emitted 1.8
        gate.record(1, True, tokens=2.4, seconds=0.05, emitted=1.8)
        gate.record(1, False, tokens=1.0, seconds=0.025)  # plain: 40 tokens/s
    assert gate.correction == pytest.approx(0.75)
    assert gate._compare(1)[0] is False  # 48 expected tokens/s, 36 emitted: plain steps win
    assert "emitted 36 tokens of 48.0 expected" in gate.summary()


def test_the_correction_starts_at_one_and_forgets_early_errors():
    """The first drafts are priced before the calibration has learned anything (a context draft of
    9 tokens expected from one earlier occurrence); once expectations are right, the correction
    returns to about 1 instead of holding those first steps against drafting for good."""
    gate = StepGate(warmup_steps=2)
    assert gate.correction == 1.0
    for _ in range(4):  # four wildly overconfident steps
        gate.record(1, True, tokens=9.0, seconds=0.03, emitted=1.0)
    assert gate.correction < 0.6
    for _ in range(200):  # then expectations that hold, and plain steps between them
        gate.record(1, True, tokens=2.0, seconds=0.03, emitted=2.0)
        gate.record(1, False, tokens=1.0, seconds=0.025)
    assert gate.correction == pytest.approx(1.0, abs=0.01)
    stale = StepGate(warmup_steps=2)
    for _ in range(4):
        stale.record(1, True, tokens=9.0, seconds=0.03, emitted=1.0)
    for _ in range(200):  # no drafting at all: the old evidence fades
        stale.record(1, False, tokens=1.0, seconds=0.025)
    assert stale.correction == pytest.approx(1.0, abs=0.02)
    steady = StepGate(warmup_steps=2)
    for _ in range(300):  # a steady winner's curse is kept, less the prior's pull
        steady.record(1, True, tokens=2.0, seconds=0.03, emitted=1.6)
    assert 0.8 < steady.correction < 0.86


def test_a_drafting_step_that_catches_the_head_up_is_not_measured_and_the_next_one_is():
    """After plain steps the head first catches up on the tokens it skipped: a cost of switching,
    not of drafting. The gate measures the drafting step after it instead, so a drafting probe is
    two steps, and its interval is set for two."""
    gate = StepGate(probe_every=4, max_probe_every=64, warmup_steps=2, probe_budget=1.0)
    decisions, caught_up = [], []
    previous = False
    for _ in range(40):
        drafted = gate.drafts(4)
        catching_up = drafted and not previous  # the head skipped the last step (or the prompt)
        # drafting steadily emits 20 tokens/s, twice the plain rate; a catch-up step takes 10x as long
        rate = 2.0 if catching_up else 20.0 if drafted else 10.0
        gate.record(4, drafted, tokens=4, seconds=4 / rate, catching_up=catching_up)
        decisions.append(drafted)
        caught_up.append(catching_up)
        previous = drafted
    # warm-up: a catch-up step and two measured drafting steps, then two plain steps ...
    assert decisions[:5] == [True, True, True, False, False]
    assert gate.measured[(4, True)].rate == pytest.approx(20.0)  # catch-up steps never counted
    # ... after which drafting (measured at its steady rate) is kept; every plain probe is followed
    # by a catch-up step and a measured drafting step
    assert decisions[5:].count(False) >= 5
    for step in range(5, 39):
        if not decisions[step]:
            assert decisions[step + 1] and caught_up[step + 1] and decisions[step + 2]
    # Without the exclusion, the same steps lose: the warm-up's catch-up step sets the average.
    naive = StepGate(probe_every=4, max_probe_every=64, warmup_steps=2, probe_budget=1.0)
    naive.record(4, True, tokens=4, seconds=2.0)
    for _ in range(2):
        naive.record(4, True, tokens=4, seconds=0.2)
        naive.record(4, False, tokens=4, seconds=0.4)
    assert naive._compare(4)[0] is False
    # A drafting probe is two steps: its interval is set for two, a plain probe's for one.
    budgeted = StepGate(probe_every=8, max_probe_every=256, probe_budget=0.02)
    assert (budgeted.probe_interval(1.5, 1), budgeted.probe_interval(1.5, 2)) == (25, 50)


def test_the_generator_flags_a_drafting_step_after_plain_steps_as_catching_up():
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, EagleConfig())
    cost = CostCurve((1, 4, 8, 16), (1.0, 1.05, 1.1, 1.2))
    generator = SpeculativeGenerator(model, head, context=True, adaptive=True, cost=cost)
    pattern, flags = "dddppdpdd", []

    class Scripted:
        step = 0

        def drafts(self, batch):
            self.step += 1
            return pattern[(self.step - 1) % len(pattern)] == "d"

        def record(self, batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
            flags.append((drafted, catching_up))

    generator.step_gate = Scripted()
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(5))
    generator.generate(prompt, max_new_tokens=40)
    assert flags[: len(pattern)] == [
        (True, True),  # the head catches up on the prompt
        (True, False),
        (True, False),
        (False, False),
        (False, False),
        (True, True),  # ... on the two plain steps
        (False, False),
        (True, True),
        (True, False),
    ]


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

    def spy(batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
        recorded.append((drafted, tokens, emitted))
        assert expected is None or expected == pytest.approx(tokens)  # one row: its own expectation
        record(batch, drafted, tokens, seconds, emitted, expected, catching_up)

    generator.step_gate.record = spy
    prompt = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(5))
    result = generator.generate(prompt, max_new_tokens=30)
    drafted = [tokens for did, tokens, _ in recorded if did]
    assert drafted and all(tokens >= 1.0 for tokens in drafted)
    assert any(tokens != int(tokens) for tokens in drafted)  # expected, not counted
    assert sum(drafted) != result.stats.new_tokens - 1  # not the tokens the steps emitted
    # ... which come along, to correct the expectations; plain steps count what they emit
    emitted = [count for did, _, count in recorded if did]
    assert all(count is not None and count >= 1 for count in emitted)
    assert all(count is None for did, _, count in recorded if not did)
    decay = generator.step_gate.correction_decay  # the sums fade with every recorded step
    assert generator.step_gate.emitted_tokens == pytest.approx(
        sum(count * decay ** (len(recorded) - 1 - i) for i, (did, _, count) in enumerate(recorded) if did)
    )


def test_a_batch_drafting_step_counts_its_least_advanced_row_in_every_row():
    """A batch is done when its slowest row is, so a drafting step is weighed by the rows times the
    smallest of the rows' expected tokens; the corrections still hold all rows' expectations
    against all rows' emitted tokens."""
    model = make_tiny_llama()
    torch.manual_seed(0)
    head = build_head(model, EagleConfig())
    cost = CostCurve((1, 4, 8, 16), (1.0, 1.05, 1.1, 1.2))
    generator = SpeculativeGenerator(model, head, context=True, adaptive=True, cost=cost)
    generator.batch_costs[2] = cost
    generator.step_gate = gate_that_measured(drafting_pays=True, batch=2)
    recorded = []
    record = generator.step_gate.record

    def spy(batch, drafted, tokens, seconds, emitted=None, expected=None, catching_up=False):
        recorded.append((batch, drafted, tokens, emitted, expected))
        record(batch, drafted, tokens, seconds, emitted, expected, catching_up)

    generator.step_gate.record = spy
    repeat = torch.tensor([7, 8, 9, 10] * 5)  # the context drafter expects much of this row
    other = torch.randint(3, 256, (17,), generator=torch.Generator().manual_seed(5))
    generator.generate([repeat, other], max_new_tokens=24)
    drafting = [(tokens, expected) for batch, did, tokens, _, expected in recorded if did and batch == 2]
    assert drafting and all(2.0 <= tokens <= expected + 1e-9 for tokens, expected in drafting)
    assert any(tokens < expected - 0.1 for tokens, expected in drafting)  # the rows' expectations differ
    decay = generator.step_gate.correction_decay  # the sums fade with every recorded step
    assert generator.step_gate.expected_tokens == pytest.approx(
        sum(
            expected * decay ** (len(recorded) - 1 - i)
            for i, (_, did, _, _, expected) in enumerate(recorded)
            if did
        )
    )
