import itertools
import math

import pytest
import torch

from draftheads.train.schedule import build_scheduler, learning_rate_factor


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    warmup, total, floor = 4, 20, 0.1
    factors = [learning_rate_factor(step, warmup, total, floor) for step in range(25)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    # midpoint of the cosine: halfway between peak and floor
    assert factors[12] == pytest.approx(floor + (1 - floor) * 0.5)
    assert factors[20] == pytest.approx(floor)
    assert factors[24] == pytest.approx(floor)  # stays at the floor past total_steps
    decay = factors[4:21]
    assert all(a >= b for a, b in itertools.pairwise(decay))


def test_no_warmup_starts_at_peak():
    assert learning_rate_factor(0, 0, 10, 0.0) == pytest.approx(1.0)
    assert learning_rate_factor(5, 0, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_scheduler_drives_the_optimizer_and_survives_state_dict():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=2.0)
    scheduler = build_scheduler(optimizer, warmup_steps=2, total_steps=6, min_lr_ratio=0.25)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:2] == pytest.approx([1.0, 2.0])
    state = scheduler.state_dict()
    fresh_optimizer = torch.optim.SGD([parameter], lr=2.0)
    fresh = build_scheduler(fresh_optimizer, warmup_steps=2, total_steps=6, min_lr_ratio=0.25)
    fresh.load_state_dict(state)
    assert fresh.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    assert fresh.get_last_lr()[0] == pytest.approx(2.0 * 0.25)
