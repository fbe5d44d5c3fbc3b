"""A run without a launcher chooses a free local port for its one-process group; when another
process takes that port before the group listens on it, the run chooses another."""

from __future__ import annotations

import os
import subprocess
import sys

PROGRAM = """
import os, socket
from draftheads.distributed import free_port as real_free_port
from draftheads.train import process_group

taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
ports = [taken.getsockname()[1]]  # the first choice is already in use

def choose():
    return ports.pop(0) if ports else real_free_port()

process_group.free_port = choose
rank, world_size, device = process_group.init_distributed()
print("joined", rank, world_size, os.environ["MASTER_PORT"] != str(taken.getsockname()[1]))
"""


def test_a_taken_port_is_replaced_by_another():
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "joined 0 1 True" in result.stdout
