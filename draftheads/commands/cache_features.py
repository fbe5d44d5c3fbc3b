"""``draftheads cache-features --config FILE [key=value ...]``: write a run's hidden-state cache.

Uses the same run config as ``draftheads train``: the base model, the data pipeline and the head
section decide what is stored (``head.required_hidden_states`` of that head); the cache goes to
``data.features``, which is also where training with that config reads it. Any head whose hidden
states the cache holds may train from it (an EAGLE-3 cache, hs[2, 15, 27, L], serves Medusa, EAGLE
and MTP too, on the same data). Re-running continues with the shards not yet written.

    draftheads cache-features --config configs/smollm2_medusa_cpu.yaml data.features=/tmp/medusa-features
    draftheads train --config configs/smollm2_medusa_cpu.yaml data.features=/tmp/medusa-features

Under a launcher each process writes its share of the shards (one base model per GPU), and rank 0
the one index; training reads the cache whatever its own world size:

    torchrun --nproc_per_node 8 $(which draftheads) cache-features --config FILE data.features=DIR

``--compute-dtype bfloat16`` runs the base in bf16 for the cache alone (the cache's identity is
still the run's base, so training in fp32 reads it; the index records the dtype the base ran in).
"""

from __future__ import annotations

import argparse

from draftheads.arguments import positive_int
from draftheads.data.features import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DTYPE,
    DEFAULT_EXAMPLES_PER_SHARD,
    STORAGE_DTYPES,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, help="run config YAML (see configs/); data.features is the output"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. data.features=/tmp/features"
    )
    parser.add_argument(
        "--dtype", default=DEFAULT_DTYPE, choices=sorted(STORAGE_DTYPES), help="storage dtype"
    )
    parser.add_argument(
        "--compute-dtype",
        default=None,
        choices=sorted(STORAGE_DTYPES),
        help="run the base in this dtype (default: model.dtype); bfloat16 on a CPU with AVX512_BF16 "
        "writes faster, and the cache still serves the run's model.dtype "
        '(docs/training.md, "Feature caches")',
    )
    parser.add_argument("--examples-per-shard", type=positive_int, default=DEFAULT_EXAMPLES_PER_SHARD)
    parser.add_argument(
        "--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, help="examples per base forward"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from draftheads.base_model import load_base, resolve_dtype
    from draftheads.config import load_run_config
    from draftheads.data.feature_identity import CacheIdentity
    from draftheads.data.features import write_feature_cache
    from draftheads.data.pipeline import build_datasets
    from draftheads.distributed import barrier, join_process_group
    from draftheads.heads import build_head
    from draftheads.settings import ConfigError

    # Bad input (ConfigError, DataError) and a base that cannot load (BaseModelError) end the
    # command as one line with the exit status of their kind, in draftheads.cli.main.
    run = load_run_config(args.config, args.overrides)
    if not run.data.features:
        raise ConfigError("data.features: set the cache directory to write, e.g. data.features=/tmp/features")
    if run.head is None:
        raise ConfigError("head: missing; the head decides which hidden states are cached")
    rank, world_size, device = join_process_group()
    dtype = resolve_dtype(run.model.dtype, device)
    base_model, tokenizer = load_base(run.model.base, dtype, device, run.model.attn_implementation)
    # Rank 0 builds the tokenised data; the others then read its datasets cache.
    if rank == 0:
        train, validation, _ = build_datasets(run.data, tokenizer, run.model.base)
    barrier(world_size)
    if rank != 0:
        train, validation, _ = build_datasets(run.data, tokenizer, run.model.base)
    try:
        head = build_head(base_model, run.head, run.model.base)
    except (ValueError, IndexError) as err:
        raise ConfigError(f"head ({run.head.kind}): {err}") from err
    splits = {"train": train, "validation": validation}
    # The identity names the base the run trains against; the forward may run in another dtype.
    identity = CacheIdentity.build(base_model, run.model.base, tokenizer, head, splits, run.data.max_length)
    if args.compute_dtype is not None:
        base_model.to(STORAGE_DTYPES[args.compute_dtype])
    write_feature_cache(
        base_model,
        splits,
        run.data.features,
        identity,
        dtype=args.dtype,
        examples_per_shard=args.examples_per_shard,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        rank=rank,
        world_size=world_size,
    )
    return 0
