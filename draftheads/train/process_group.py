"""The process group a training run joins: the launcher's, or a one-process group of its own."""

from __future__ import annotations

import os

import torch

from draftheads.distributed import apply_timeout_to_every_group, distributed_timeout, free_port, local_device

PORT_ATTEMPTS = 5  # local ports tried by a run without a launcher


def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, without a launcher, create) the process group; return (rank, world size, device).

    The ``deepspeed`` launcher (or ``torchrun``) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*; a plain
    ``draftheads train`` becomes rank 0 of 1 on a free local port. Collectives fail after
    ``draftheads.distributed.distributed_timeout()``, on the world group and on the groups
    DeepSpeed makes for gradients and ZeRO alike. The group lives until the process exits:
    DeepSpeed caches its groups, so it cannot be torn down and rebuilt in-process.
    """
    import deepspeed

    alone = "RANK" not in os.environ
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = local_device()
    timeout = distributed_timeout()
    apply_timeout_to_every_group(timeout)  # DeepSpeed's own groups, made later, too
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Alone, the port was free when chosen but another process may take it before the store
    # listens on it: choose again (a launcher's MASTER_PORT is the launcher's to choose).
    for attempt in range(PORT_ATTEMPTS):
        try:
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
            break
        except torch.distributed.DistNetworkError:
            if not alone or attempt == PORT_ATTEMPTS - 1:
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device
