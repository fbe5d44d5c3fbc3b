"""``draftheads data inspect --config FILE [key=value ...]``: build a run's datasets and report on them.

Prints conversations read / kept / dropped (with reasons and examples), the truncated tail of the
source, token totals, the assistant-token share, a length histogram, the padding the run's
micro-batches would compute on ``--ranks`` data-parallel ranks, and the time taken. A second run
with the same inputs hits the datasets cache and is instant.
"""

from __future__ import annotations

import argparse

from draftheads.data.pipeline import DataReport, dropped_records

BAR_WIDTH = 40


def format_drop_summary(report: DataReport) -> str:
    """What reading the source kept and dropped, with reasons and examples (``data inspect`` and
    ``train`` print it)."""
    lines = [f"source: {report.source}", f"conversations read: {report.conversations_read:,}"]
    tail = report.truncated_tail
    if tail is not None:
        lines.append(
            f"  truncated tail: the file stops inside a record at byte {tail.byte_offset:,} "
            f"({tail.bytes_skipped:,} bytes skipped: {tail.message})"
        )
    lines.append(f"usable conversations: {report.conversations_valid:,}")
    lines.append(
        f"examples kept: {report.examples:,} (train {report.train_examples:,}, "
        f"validation {report.validation_examples:,})"
    )
    dropped = sum(report.dropped.values())
    records = dropped_records(report.dropped)
    share = records / report.conversations_read if report.conversations_read else 0.0
    lines.append(
        f"dropped: {dropped:,}"
        + (
            f" ({records:,} malformed or unusable records, {share:.1%} of those read)"
            if dropped
            else " (none)"
        )
    )
    for reason, count in sorted(report.dropped.items(), key=lambda item: -item[1]):
        lines.append(f"  {reason}: {count:,}")
        lines.extend(f"    e.g. {example}" for example in report.drop_examples.get(reason, []))
    for repair, count in report.repairs.items():
        lines.append(f"repaired: {repair}: {count:,}")
    for extra in report.extra_sources:
        drops = ", ".join(f"{reason} {count:,}" for reason, count in extra["dropped"].items()) or "none"
        lines.append(
            f"extra source (training only): {extra['source']}: {extra['conversations_read']:,} "
            f"conversations read, {extra['examples']:,} examples kept, {extra['tokens']:,} tokens "
            f"({extra['assistant_tokens']:,} under the loss mask); dropped: {drops}"
        )
    return "\n".join(lines)


def format_report(report: DataReport) -> str:
    """The human-readable report ``data inspect`` prints: the drop summary, then tokens, the loss
    mask, the length histogram and the time taken."""
    lines = [format_drop_summary(report)]
    lines.append(
        f"tokens: {report.tokens:,} in kept examples, {report.assistant_tokens:,} under the loss mask "
        f"(assistant-token share {report.assistant_share:.1%}); "
        f"{report.truncated_examples:,} examples cut to max_length={report.max_length}"
    )
    methods = ", ".join(f"{name} {count:,}" for name, count in report.mask_methods.items())
    lines.append(
        f"loss mask ({report.template} rendering): assistant content + {report.template_end_of_turn!r}; "
        f"method: {methods}; "
        f"tokens straddling a mask edge: {report.boundary_tokens}"
    )
    lines.append("length histogram (tokens per example):")
    peak = max((count for _, _, count in report.length_histogram), default=0) or 1
    for low, high, count in report.length_histogram:
        bar = "#" * round(BAR_WIDTH * count / peak)
        upper = f"{high - 1:>6}]" if high > report.max_length else f"{high:>6})"  # last bin: inclusive
        lines.append(f"  [{low:>6}, {upper}  {count:>7,}  {bar}")
    origin = "cache hit" if report.cache_hit else "built and cached"
    lines.append(f"time: {report.seconds:.2f} s ({origin}: {report.cache_path})")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    inspect = actions.add_parser("inspect", help="build the datasets of a run config and report on them")
    inspect.add_argument("--config", help="run config YAML (defaults are used for anything it leaves out)")
    inspect.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. data.limit=100")
    inspect.add_argument(
        "--ranks", type=int, default=1, help="data-parallel ranks the padding report assumes (default 1)"
    )


def run(args: argparse.Namespace) -> int:
    from draftheads.base_model import load_tokenizer
    from draftheads.config import load_run_config
    from draftheads.data.pipeline import build_datasets, row_lengths
    from draftheads.settings import ConfigError
    from draftheads.train.padding import padding_report

    if args.ranks < 1:
        raise ConfigError(f"--ranks {args.ranks}: must be at least 1")
    run_config = load_run_config(args.config, args.overrides)
    tokenizer = load_tokenizer(run_config.model.base)
    train_dataset, _, report = build_datasets(run_config.data, tokenizer, run_config.model.base)
    print(format_report(report))
    train = run_config.train
    lengths = row_lengths(train_dataset)
    print(
        padding_report(lengths, train.micro_batch_size, args.ranks, train.seed, train.group_by_length).line()
    )
    return 0
