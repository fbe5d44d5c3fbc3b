"""Every collective a training rank runs gives up after the configured timeout, including those on
the groups DeepSpeed makes itself (torch gives a group made without a timeout 30 minutes, which
is how a hung rank once held the other for half an hour)."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from draftheads.distributed import apply_timeout_to_every_group
from tests.train.distributed_launch import ROOT, launch_environment

# Run in a fresh process: the process group, and DeepSpeed's groups, live until the process exits.
_PROBE = """
import torch
from deepspeed.utils import groups
from draftheads.train.process_group import init_distributed

init_distributed()
for name, group in (("world", torch.distributed.group.WORLD), ("deepspeed", groups._clone_world_group())):
    backend = group._get_backend(torch.device("cpu"))
    print(name, backend.options._timeout.total_seconds())
"""


def test_deepspeeds_groups_get_the_configured_timeout():
    environment = {**launch_environment(), "DRAFTHEADS_DISTRIBUTED_TIMEOUT": "17"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        check=False,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    timeouts = dict(
        line.split() for line in probe.stdout.splitlines() if line.startswith(("world ", "deepspeed "))
    )
    assert timeouts == {"world": "17.0", "deepspeed": "17.0"}


def test_a_timeout_must_be_positive():
    c10d = torch.distributed.distributed_c10d
    before = c10d.default_pg_timeout
    with pytest.raises(ValueError, match="positive"):
        apply_timeout_to_every_group(timedelta(0))
    assert c10d.default_pg_timeout == before
