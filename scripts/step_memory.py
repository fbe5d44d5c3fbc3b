"""Peak resident memory of the first and second training steps of a run, on a CPU.

Sets the run up in this process (as ``draftheads train`` does), then runs one optimizer step and
then a second, sampling the process's resident memory every 20 ms during each. The first step
allocates Adam's state only at its optimizer step; the second holds it through its forward, the
steady state a long run repeats. Prints one JSON line (GiB and seconds), the figures ``draftheads
plan --target cpu`` is checked against (docs/gpu.md).

    python scripts/step_memory.py --config configs/llama3-8b_eagle3_8gpu.yaml model.base=BASE ...
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time

GIB = 2**30
SAMPLE_SECONDS = 0.02


def measured_steps(run, steps: int, process) -> tuple[float, float, float]:
    """(resident bytes before, peak resident bytes during, seconds) of training up to ``steps``."""
    from draftheads.train import loop

    before = process.memory_info().rss
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    run.total_steps = steps
    try:
        loop.train_steps(run)
    finally:
        done.set()
        sampler.join()
    return before, peak[0], time.perf_counter() - started


def main() -> None:
    import psutil

    from draftheads.config import load_run_config
    from draftheads.train import loop
    from draftheads.train.setup import setup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides (train.max_steps is set here)"
    )
    args = parser.parse_args()
    config = load_run_config(args.config, [*args.overrides, "train.epochs=null", "train.max_steps=2"])
    process = psutil.Process()
    run = setup(config)
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    try:
        first = measured_steps(run, 1, process)
        second = measured_steps(run, 2, process)
    finally:
        loop.cleanup(run)
    print(
        json.dumps(
            {
                "tokens": config.data.max_length,
                "setup_peak_gib": setup_peak / GIB,
                "after_setup_gib": first[0] / GIB,
                "first_step_peak_gib": first[1] / GIB,
                "first_step_seconds": first[2],
                "before_second_step_gib": second[0] / GIB,
                "second_step_peak_gib": second[1] / GIB,
                "second_step_seconds": second[2],
                "overrides": args.overrides,
            }
        )
    )


if __name__ == "__main__":
    main()
