"""Tune a head's tree for this machine: measure acceptance and cost, choose, save.

No fixed tree is right everywhere: how many candidates pay off depends on how often the head is right
at each depth and rank (``acceptance``), and on what verifying N tokens and drafting cost here
(``cost``; on a CPU verifying N tokens grows with N, on a GPU it is nearly flat up to dozens).
``search`` chooses. The choice is saved with the head (``tree.json``, keyed by device and dtype, read
by ``draftheads.infer.tree.load_tuned_tree``), with the measured curves (``tune-<device>-<dtype>.json``)
and a chart (``.png``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftheads.base_model import DEFAULT_DTYPE
from draftheads.device import DEFAULT_DEVICE
from draftheads.export.checkpoint import dtype_name
from draftheads.heads.base import inside_head, read_json_object
from draftheads.infer.int8 import has_int8_linears
from draftheads.infer.precision import DEFAULT_DRAFT_DTYPE, INT8
from draftheads.infer.tree import TUNED_TREE_FILE, TUNED_TREE_FORMAT, tree_to_dict, tuned_tree_key
from draftheads.infer.verify_cost import CostCurve, costs_to_dict
from draftheads.prompt_format import DEFAULT_TEMPLATE, choose_template, stop_strings
from draftheads.storage import write_text_atomically
from draftheads.tuning.acceptance import head_vocab_size, measure_acceptance, measured_depth
from draftheads.tuning.held_out import greedy_continuations, held_out_prompts
from draftheads.tuning.report import plot_tuning
from draftheads.tuning.search import Candidate, choose_dynamic_tree, choose_static_tree
from draftheads.tuning.step_cost import DecodingBench, cost_sizes

# The cost curve is only right if nothing else ran while it was timed: another process on a core
# slows some forwards more than others and skews the curve, and the tree chosen on it costs more
# than it predicts (docs/inference.md, "Measured facts the code relies on"). So the one-token
# verification is timed again after everything else; if the two medians differ by more than this
# fraction, the record says so and the report warns. It catches a disturbance that covers one of the
# two timings; one that slows the whole tuning passes it.
TIMING_DRIFT_TOLERANCE = 0.10


def drafts_in(head) -> str:
    """What the head drafts in: ``int8`` (``draftheads.infer.int8``) or its parameters' dtype."""
    return INT8 if has_int8_linears(head) else dtype_name(head)


def timing_check(before: float, after: float) -> dict:
    """The one-token verify medians at the start and the end of tuning's timings, and whether they
    agree within ``TIMING_DRIFT_TOLERANCE`` (relative to the faster)."""
    drift = abs(after - before) / min(before, after)
    return {
        "one_token_seconds": [before, after],
        "drift": drift,
        "tolerance": TIMING_DRIFT_TOLERANCE,
        "quiet": drift <= TIMING_DRIFT_TOLERANCE,
    }


@dataclass(frozen=True)
class TuneSettings:
    """Every default of ``draftheads tune-tree`` (the CLI only overrides these)."""

    # prompts: mt-bench | humaneval | a prompt .jsonl (bench's form) | a conversation source
    # (first user turns)
    data: str = "sharegpt"
    template: str = DEFAULT_TEMPLATE  # how the prompts are rendered: auto | chat | plain (prompt_format)
    # skip the first N prompts: the small shipped configs train on ShareGPT's first 2,600 (eagle3:
    # 9,000); the corpus heads train on all of it, so tune those on other prompts (a prompt file)
    skip: int = 10000
    prompts: int = 8  # held-out prompts
    max_new_tokens: int = 128  # greedy continuation per prompt (the positions measured)
    max_prompt_tokens: int = 256  # longer prompts are skipped
    top_k: int = 8  # ranks measured per depth
    max_depth: int = 6  # depths measured for heads without a fixed depth (EAGLE)
    max_nodes: int = 64  # largest tree considered (root included)
    prefix_tokens: int = 200  # context before the timed tree forwards
    repeats: int = 5  # timed repeats (median)
    batch_sizes: tuple[int, ...] = (2, 4, 8, 16)  # batched verify costs measured for batch decoding
    batch_max_nodes: int = 32  # largest per-row tree timed at those batch sizes
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    draft_dtype: str = DEFAULT_DRAFT_DTYPE  # the head's own (draftheads.infer.precision): drafting cost


def save_tuned_tree(
    head_dir: Path, key: str, best: Candidate, record: dict, costs: dict[int, CostCurve]
) -> list[Path]:
    """Merge the choice for ``key`` into ``tree.json``; write the curves and a chart next to it."""
    tree_path = inside_head(head_dir, head_dir / TUNED_TREE_FILE)  # never merged from a link out
    saved = {"format": TUNED_TREE_FORMAT, "trees": {}}
    if tree_path.is_file():
        previous = read_json_object(tree_path)
        if previous.get("format") == TUNED_TREE_FORMAT:
            saved = previous
    saved["trees"][key] = {
        "tree": tree_to_dict(best.tree),
        "expected_tokens_per_step": best.expected_tokens,
        "expected_speedup": best.expected_speedup,
        "machine": record["machine"],
        "verify_costs": costs_to_dict(costs),  # by batch size; adaptive drafting weighs trees with them
    }
    write_text_atomically(tree_path, json.dumps(saved, indent=2) + "\n")
    stem = "tune-" + key.replace("/", "-")
    curves_path = head_dir / f"{stem}.json"
    write_text_atomically(curves_path, json.dumps(record, indent=2) + "\n")
    return [tree_path, curves_path, *plot_tuning(record, head_dir / f"{stem}.png")]


def tune_tree(
    model, head, tokenizer, head_dir: str | Path, settings: TuneSettings, progress: bool = True
) -> dict:
    """Measure, choose and save; returns the record written to ``tune-<device>-<dtype>.json``."""
    from draftheads.infer.generate import SpeculativeGenerator
    from draftheads.infer.packed import has_packed_linears, packed_description
    from draftheads.machine import machine_info

    head_dir = Path(head_dir)
    generator = SpeculativeGenerator(model, head, tokenizer)  # its default tree; its padding rule
    pad = generator.pad_to_multiple
    template = choose_template(settings.template, tokenizer, "--template")
    prompts = held_out_prompts(
        settings.data, settings.skip, settings.prompts, tokenizer, settings.max_prompt_tokens, template
    )
    sequences = greedy_continuations(
        generator, prompts, settings.max_new_tokens, progress, stop_strings(template)
    )
    depth = measured_depth(head, settings.max_depth)
    top_k = min(settings.top_k, head_vocab_size(head))
    acceptance = measure_acceptance(model, head, sequences, depth, top_k, progress)

    prefix = torch.cat([tokens for tokens, _ in sequences])[: settings.prefix_tokens]
    bench = DecodingBench(model, head, prefix, pad, settings.repeats)
    curve = bench.verify_cost(cost_sizes(settings.max_nodes, pad), progress)
    one_step = curve.seconds[curve.sizes.index(1)]
    batch_sizes = cost_sizes(min(settings.batch_max_nodes, settings.max_nodes), pad)
    costs = {1: curve} | {b: bench.batch_verify_cost(b, batch_sizes, progress) for b in settings.batch_sizes}

    def draft_cost(tree) -> float:
        return bench.draft_seconds(tree) / one_step

    drafter = generator.new_drafter()
    dynamic = drafter.dynamic_trees and drafter.max_depth < 0  # EAGLE: unbounded depth
    if dynamic:
        best, candidates = choose_dynamic_tree(
            acceptance, curve.relative, draft_cost, top_k, depth, settings.max_nodes, pad
        )
    else:
        best, candidates = choose_static_tree(acceptance, curve.relative, draft_cost, settings.max_nodes, pad)
    # after the search, which timed the drafting: the start and the end of every timing
    timings = timing_check(one_step, bench.verify_cost([1], progress=False).seconds[0])
    key = tuned_tree_key(model.dtype, model.device)
    record = {
        "setting": key,
        "settings": asdict(settings),
        "machine": machine_info(model.dtype, str(model.device)),
        "head": {"kind": head.kind, "dir": str(head_dir), "draft_dtype": drafts_in(head)},
        "tau_convention": "expected tokens per step count the token the base model produces itself",
        "acceptance": asdict(acceptance),
        "verify_cost": {
            "sizes": list(curve.sizes),
            "seconds": list(curve.seconds),
            "fitted_seconds": curve.fitted(),
            "relative": [curve.relative(n) for n in curve.sizes],
            "pad_to_multiple": pad,
            "packed_linears": has_packed_linears(model),  # for the multi-token forwards it times
            "kernels": packed_description(model),
            "ceiling": {
                **dict(zip(("speedup", "tokens"), curve.ceiling())),
                "at_tau": [curve.speedup_bound(tau) for tau in (2, 3, 4)],
            },
        },
        "verify_cost_by_batch": {
            str(b): {
                "sizes": list(c.sizes),
                "seconds": list(c.seconds),
                "relative": [c.relative(n) for n in c.sizes],
            }
            for b, c in sorted(costs.items())
        },
        "timing_check": timings,
        "chosen": _candidate_dict(best),
        "candidates": [_candidate_dict(c) for c in candidates],
    }
    record["paths"] = [str(p) for p in save_tuned_tree(head_dir, key, best, record, costs)]
    return record


def _candidate_dict(candidate: Candidate) -> dict:
    return {
        "tree": tree_to_dict(candidate.tree),
        "nodes": candidate.nodes,
        "expected_tokens": candidate.expected_tokens,
        "cost": candidate.cost,
        "expected_speedup": candidate.expected_speedup,
    }
