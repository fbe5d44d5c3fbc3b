"""Joining the data-parallel process group that a launcher (``deepspeed``, ``torchrun``) started.

A launcher starts one process per device and tells each its place through the environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). ``draftheads train`` joins through
DeepSpeed (``draftheads.train.process_group.init_distributed``), ``draftheads cache-features`` through
``join_process_group``; both wait at most ``distributed_timeout()`` in any collective, so a rank
that died or hangs makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from draftheads.device import AUTO, check_device
from draftheads.settings import ConfigError

# How long a rank waits in a collective (all-reduce, barrier) before failing. A checkpoint save,
# an evaluation, rank 0's data build, and rank 0's work after the last step (the head, the curves)
# before the barrier at the end must fit in it. The environment variable overrides it.
DISTRIBUTED_TIMEOUT_SECONDS = 1800
DISTRIBUTED_TIMEOUT_VARIABLE = "DRAFTHEADS_DISTRIBUTED_TIMEOUT"


def distributed_timeout() -> timedelta:
    """``DISTRIBUTED_TIMEOUT_SECONDS``, or the environment's ``DRAFTHEADS_DISTRIBUTED_TIMEOUT``."""
    value = os.environ.get(DISTRIBUTED_TIMEOUT_VARIABLE)
    if value is None:
        return timedelta(seconds=DISTRIBUTED_TIMEOUT_SECONDS)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"environment {DISTRIBUTED_TIMEOUT_VARIABLE}={value!r}: expected seconds > 0")
    return timedelta(seconds=seconds)


def apply_timeout_to_every_group(timeout: timedelta) -> None:
    """Make ``timeout`` the default of every process group created from now on in this process.

    ``init_process_group(timeout=...)`` sets the world group's timeout only. DeepSpeed runs its
    gradient all-reduce and ZeRO partitioning on groups of its own (a clone of the world group,
    made by ``torch.distributed.new_group(ranks)`` with no timeout), and torch gives such groups
    its module default (30 minutes), so a hung rank would hold the others there for half an hour.
    torch reads that default from ``distributed_c10d.default_pg_timeout`` (gloo) or
    ``default_pg_nccl_timeout`` (nccl) each time a group is made.
    """
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    c10d = torch.distributed.distributed_c10d
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout


def free_port() -> int:
    """A localhost TCP port nothing listens on now: MASTER_PORT for a group no launcher set up, or
    a local server's port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launched_world_size() -> int:
    """WORLD_SIZE set by a launcher (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device() -> torch.device:
    """This process's device: the GPU of its LOCAL_RANK (made current) where CUDA is, else the CPU."""
    device = check_device(AUTO)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def join_process_group() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process. Under a launcher with WORLD_SIZE > 1 it joins
    the group (nccl on CUDA, gloo on CPU); alone it is rank 0 of 1 and joins nothing."""
    device = local_device()
    if launched_world_size() == 1:
        return 0, 1, device
    if not torch.distributed.is_initialized():
        timeout = distributed_timeout()
        apply_timeout_to_every_group(timeout)
        torch.distributed.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout
        )
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device


def barrier(world_size: int) -> None:
    """Wait for every rank (nothing to wait for alone)."""
    if world_size > 1:
        torch.distributed.barrier()


def leave_process_group(finished: bool) -> None:
    """Destroy this process's process groups before it exits (a no-op if it joined none).

    A process that exits with its gloo group alive can abort in interpreter finalisation: gloo's
    worker threads still hold work objects whose tensors reference Python, and destroying them then
    kills the process with SIGABRT ("terminate called without an active exception") after its work
    is done (pytorch/pytorch#190489; the analysis in pytorch/pytorch#179291). ``finished``: the
    command succeeded, so every rank gets here; they first wait for each other, so that none tears
    its connections down while another still talks to it. A rank that failed leaves at once (the
    others may never arrive). What the others see then depends on the backend and the launcher:
    under ``torchrun`` or ``deepspeed`` the launcher stops them as soon as one rank fails; without
    one, gloo ranks fail at once in the barrier (their connections close), while nccl ranks wait
    until the collective timeout.

    Only as the process ends (the console script does it): DeepSpeed caches its groups, so a
    process cannot join again.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        if finished:
            barrier(torch.distributed.get_world_size())
    finally:
        torch.distributed.destroy_process_group()
