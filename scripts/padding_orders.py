"""Padding and rank waiting of a run's training split under the epoch order the loop uses, and
under the order it replaced (mega-batches of 50 batches, batches shuffled one by one).

    python scripts/padding_orders.py --config configs/smollm2_eagle3_cpu.yaml --ranks 1,8 \
        data.max_length=2048 train.micro_batch_size=4

Prints one JSON line per (order, ranks): the report of ``draftheads.train.padding``.
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

PREVIOUS_ORDER = {"MEGABATCH_FACTOR": 50, "RANK_BLOCK": 1}


def main() -> None:
    from draftheads.base_model import load_tokenizer
    from draftheads.config import load_run_config
    from draftheads.data.pipeline import build_datasets, row_lengths
    from draftheads.train import batching
    from draftheads.train.padding import padding_report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--ranks", default="1,8", help="comma-separated data-parallel rank counts")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args()
    run = load_run_config(args.config, args.overrides)
    train_dataset, _, _ = build_datasets(run.data, load_tokenizer(run.model.base), run.model.base)
    lengths = row_lengths(train_dataset)
    orders = {
        "shipped": {"MEGABATCH_FACTOR": batching.MEGABATCH_FACTOR, "RANK_BLOCK": batching.RANK_BLOCK},
        "previous": PREVIOUS_ORDER,
    }
    for name, constants in orders.items():
        with mock.patch.multiple(batching, **constants):
            for ranks in (int(count) for count in args.ranks.split(",")):
                report = padding_report(
                    lengths, run.train.micro_batch_size, ranks, run.train.seed, run.train.group_by_length
                )
                print(
                    json.dumps(
                        {
                            "order": name,
                            **constants,
                            "rows": len(lengths),
                            "micro_batch_size": report.micro_batch_size,
                            "ranks": ranks,
                            "padding": round(report.padding, 4),
                            "waiting": round(report.waiting, 4),
                        }
                    )
                )


if __name__ == "__main__":
    main()
