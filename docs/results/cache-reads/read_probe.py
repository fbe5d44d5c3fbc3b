"""Disk bytes and time to read random rows of a feature cache: safetensors' memory map against ShardFile.

    python docs/results/cache-reads/read_probe.py CACHE_DIR [ROWS] [ROUNDS]

Each round draws ROWS random training rows (fresh seeds, so rows a round before left in the page
cache are rarely met again) and reads every stored tensor of each row, as training does, once
through ``safetensors.safe_open`` (a memory map) and once through ``ShardFile`` (pread, no
read-ahead), alternating which goes first. Bytes from disk are the process's ``read_bytes``
(/proc/self/io), which counts page-fault reads as well; "needed" is what the rows hold.
"""

import json
import random
import sys
import time
from pathlib import Path

from safetensors import safe_open

from draftheads.data.shard_file import ShardFile


def disk_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def read_rows(open_shard, slice_rows, directory: Path, per_shard: int, rows: list[int]) -> int:
    """Reads every tensor of ``rows``; returns the bytes they hold."""
    held, shards = 0, {}
    for row in rows:
        shard, local = divmod(row, per_shard)
        if shard not in shards:
            shards[shard] = open_shard(directory / "train" / f"shard-{shard:05d}.safetensors")
        handle = shards[shard]
        start, stop = slice_rows(handle, "offsets", local, local + 2).tolist()
        for name in handle.keys():  # noqa: SIM118 (safetensors' handle is not iterable)
            if name != "offsets":
                tensor = slice_rows(handle, name, start, stop)
                tensor.float().sum()  # touch every byte: a memory map reads on first touch
                held += tensor.numel() * tensor.element_size()
    return held


def main() -> None:
    directory = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    index = json.loads((directory / "index.json").read_text())
    per_shard, examples = index["examples_per_shard"], index["identity"]["examples"]["train"]
    readers = {
        "safetensors mmap": (
            lambda path: safe_open(str(path), framework="pt"),
            lambda handle, name, start, stop: handle.get_slice(name)[start:stop],
        ),
        "ShardFile pread": (ShardFile, lambda handle, name, start, stop: handle.rows(name, start, stop)),
    }
    print(f"{directory}: {examples} training rows, {count} random rows a round")
    for round_ in range(rounds):
        order = list(readers) if round_ % 2 == 0 else list(reversed(readers))
        for offset, name in enumerate(order):
            rows = random.Random(1000 * round_ + offset).sample(range(examples), count)
            before, start = disk_bytes(), time.perf_counter()
            held = read_rows(*readers[name], directory, per_shard, rows)
            seconds, read = time.perf_counter() - start, disk_bytes() - before
            print(
                f"round {round_ + 1} {name:17s} {read / 2**20:8.1f} MiB from disk for "
                f"{held / 2**20:6.1f} MiB needed ({read / held:5.1f}x), {seconds:5.2f} s"
            )


if __name__ == "__main__":
    main()
