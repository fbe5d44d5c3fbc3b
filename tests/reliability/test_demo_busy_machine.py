"""The demo under load: plain generate and the head run in turn (medians), and when the machine-speed
probes say the machine was busy the demo prints that the comparison means nothing instead of a
speedup (it once printed "speedup 17.13x" with a neighbour's load on plain generate). Scripted
runs and probe times: nothing is timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftheads.demo import compare, interleaved_runs, report


def scripted_runs(plain_seconds, speculative_seconds, probes):
    """``interleaved_runs`` over scripted runs and probes; also returns the order of the calls."""
    order, probes = [], iter(probes)
    plain_times, speculative_times = iter(plain_seconds), iter(speculative_seconds)

    def plain():
        order.append("plain")
        return [1, 2, 3, 4], next(plain_times)

    def speculative():
        order.append("speculative")
        stats = SimpleNamespace(tree="t", tau=2.0, kernels="k", new_tokens=4, seconds=next(speculative_times))
        return SimpleNamespace(stats=stats, new_tokens=[1, 2, 3, 4])

    def probe():
        order.append("probe")
        return next(probes)

    return interleaved_runs(plain, speculative, probe, len(plain_seconds)), order


def test_runs_alternate_and_the_speedup_is_of_the_medians(capsys):
    runs, order = scripted_runs([4.0, 2.0, 2.2], [1.0, 9.0, 1.1], [1.0, 1.02, 1.0, 1.05, 1.01, 1.0, 1.03])
    assert order == ["probe"] + ["plain", "probe", "speculative", "probe"] * 3
    outcome = compare(runs)
    assert outcome["plain_seconds"] == 2.2 and outcome["speculative_seconds"] == 1.1
    assert outcome["speedup"] == pytest.approx(2.0) and outcome["machine_busy"] is False
    report(outcome, "the head")
    out = capsys.readouterr().out
    assert "speedup 2.00x (median of 3 interleaved runs each)" in out and "not meaningful" not in out


@pytest.mark.parametrize(
    "probes",
    [
        [1.0, 1.3, 1.25, 1.3, 1.4, 1.3, 1.35],  # the median probe 1.3x the fastest
        [1.0, 1.0, 1.0, 2.5, 1.0, 1.0, 1.0],  # one probe 2.5x the fastest
    ],
)
def test_a_busy_machine_gets_no_speedup_figure(probes, capsys):
    runs, _ = scripted_runs([8.0, 7.5, 8.2], [0.5, 0.45, 0.5], probes)
    outcome = compare(runs)
    assert outcome["machine_busy"] is True and outcome["speedup"] is None
    report(outcome, "the head")
    out = capsys.readouterr().out
    assert "speedup: not meaningful, the machine was busy during the timed runs" in out
    assert "x (median" not in out and "16.00x" not in out
