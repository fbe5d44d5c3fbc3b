"""``draftheads bench``: acceptance length and wall-clock speedup, side by side, in one run.

Every method decodes the same prompts on the same machine, interleaved prompt by prompt (so drift
in machine speed hits all methods alike): plain HF ``generate`` in each way this machine offers
(``plain_baselines``: fp32 on PyTorch's default kernels, the first and the reference of the
``speedup`` column and of agreement; fp32 on prepacked oneDNN weights; bf16 where the CPU has native
bf16), HF prompt-lookup decoding, and draftheads speculative decoding with each given head on the
linear kernels ``draftheads.infer.kernel_choice`` chooses. Every method's
``speedup_over_fastest_plain`` is against the fastest of the plain runs, named in ``fastest_plain``:
what a user gains over the best plain decoding on that machine. Times are medians over repeats, which also
alternate between the methods, warm-up excluded. tau is reported as tokens emitted per
base-model forward, counting the token the base model produces itself (so plain decoding has
tau = 1, as EAGLE counts it).

With ``batch_sizes`` the prompts also run in batches of B (consecutive prompts; HF batched
``generate`` with left padding is the reference): throughput is tokens/s over the batch, and each
row's time is its batch's time shared evenly among the batch's rows. With ``continuous`` the
draftheads methods decode all the prompts in one call with at most B rows at once, each finished
row replaced by the next prompt (``generate(..., batch_size=B)``), while HF ``generate`` still runs
consecutive batches of B (it has no such mode); each prompt's time is then the whole run's shared
evenly.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftheads.base_model import DEFAULT_DTYPE
from draftheads.bench_output import (
    ACCEPTANCE_CHART,
    BATCH_CHART,
    RESULT_FILES,
    SPEEDUP_CHART,
    ResultFiles,
    check_charts,
)
from draftheads.device import DEFAULT_DEVICE, check_device
from draftheads.infer.generate import DEFAULT_MAX_NEW_TOKENS
from draftheads.infer.kernel_choice import DEFAULT_PACK
from draftheads.infer.packed import FORMS, packed_forms
from draftheads.infer.precision import DEFAULT_DRAFT_DTYPE, prepare_head
from draftheads.infer.stopping import StopRule
from draftheads.machine import machine_info, native_bf16
from draftheads.optional import available
from draftheads.prompt_format import DEFAULT_TEMPLATE, choose_template, prompt_ids, stop_strings
from draftheads.speed_probe import (
    QUIET_MARGIN,
    ProbeSummary,
    forward_seconds,
    quiet_limit,
    summarize_probes,
)

if TYPE_CHECKING:
    from draftheads.bench_engines import EngineSettings

TAU_CONVENTION = (
    "tokens per base-model forward, counting the token the base model produces itself (plain decoding = 1)"
)
PROMPT_LOOKUP_TOKENS = 10  # HF's documented default n-gram continuation length for prompt lookup
PLAIN = "generate"  # plain HF generate; its variants are named generate@<how>


@dataclass(frozen=True)
class BenchSettings:
    """Every default of ``draftheads bench`` (the CLI only overrides these)."""

    heads: tuple[str, ...] = ()  # head directories (draftheads or an engine format)
    base: str | None = None  # default: the base recorded in the first head
    prompts: str = "mt-bench"  # mt-bench | humaneval | FILE.jsonl
    template: str = DEFAULT_TEMPLATE  # how prompts are rendered: auto | chat | plain (prompt_format)
    limit: int | None = None  # number of prompts, spread over categories
    categories: tuple[str, ...] | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    repeats: int = 1  # timed repeats of each batch, alternating between methods (median kept)
    tree: str | None = None  # tree name or tuned-tree file (default: each head's tuned tree)
    prompt_lookup: bool = True  # include HF prompt-lookup decoding as a baseline
    context: bool = True  # include our context drafter alone (no head) as a method
    hybrid: bool = True  # include every head with context drafts merged into its trees
    suffix: bool = False  # include suffix drafts: alone (no head) and merged into every head's trees
    adaptive: bool = True  # include each drafting method with adaptive drafting too
    methods: tuple[str, ...] | None = None  # only these (names before ':'; generate always runs)
    # linear kernels of the drafting methods and prompt lookup: auto | True | False
    # (``draftheads.infer.kernel_choice``); the plain baselines each run their own
    pack: bool | str = DEFAULT_PACK
    # the dtypes each head drafts in (``draftheads.infer.precision``); several: each head once per dtype
    draft_dtypes: tuple[str, ...] = (DEFAULT_DRAFT_DTYPE,)
    seed: int = 0
    out: str = "bench-results"
    batch_sizes: tuple[int, ...] = (1,)  # run every method at each batch size (prompt lookup: 1 only)
    continuous: bool = False  # draftheads methods replace finished rows with waiting prompts
    overwrite: bool = False  # replace an earlier run's results in ``out``


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    input_ids: torch.Tensor  # (1, T)
    stop: tuple[str, ...] = ()  # stop strings its rendering implies (plain: the next user turn)


@dataclass
class Sample:
    """One method on one prompt: the generated tokens and the median time over repeats."""

    method: str
    prompt_id: str
    category: str
    new_tokens: int
    seconds: float
    forwards: int
    accepted_per_depth: list[int] = field(default_factory=list)  # drafts accepted at depth 1, 2, ...
    steps: int = 0  # decoding steps that could accept drafts (for per-depth rates)
    agrees: bool | None = None  # identical to plain generate's output (T = 0 only)
    tokens: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)  # accepted drafts by proposer
    batch_size: int = 1  # rows decoded together (its seconds are the batch's share for this row)
    repeat_seconds: list[float] = field(default_factory=list)  # each timed repeat's seconds, in order
    # per timed repeat, the machine's speed while it ran (``draftheads.speed_probe``): the slowest
    # of the probes taken between the methods' runs of that repeat, before the first and after the
    # last; and whether that repeat ran quiet. Empty when the run took no probes; no flags when it
    # had a single repeat of a single batch (nothing to compare it with).
    repeat_probe_seconds: list[float] = field(default_factory=list)
    quiet_repeats: list[bool] = field(default_factory=list)


class ForwardCounter:
    """Counts forward calls of a module while active (HF generate does not report them)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.count = 0
        self._handle = None

    def __enter__(self):
        self.count = 0
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *_):
        self.count += 1

    def __exit__(self, *exc):
        self._handle.remove()


def _sampling_kwargs(temperature: float, seed: int) -> dict:
    if temperature <= 0:
        return {"do_sample": False}
    torch.manual_seed(seed)
    return {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}


def consecutive_batches(prompts: list[BenchPrompt], size: int) -> list[list[BenchPrompt]]:
    """The prompts in batches of ``size`` consecutive prompts (the last may be smaller); batch i
    decodes with seed ``seed + i`` whichever way it is run."""
    return [prompts[start : start + size] for start in range(0, len(prompts), size)]


def batch_stop_strings(prompts: list[BenchPrompt]) -> tuple[str, ...]:
    """The stop strings of a batch's prompts (all rendered alike), for every method alike."""
    return tuple(sorted({string for prompt in prompts for string in prompt.stop}))


def is_plain(method: str) -> bool:
    """Whether a method name is one of plain ``generate``'s (``generate`` or ``generate@<how>``)."""
    return method == PLAIN or method.startswith(PLAIN + "@")


def timed_generate(model, ids, attention_mask, max_new_tokens: int, pad_token_id: int, **sampling):
    """HF ``generate`` on ``ids`` (B, T) timed: (sequences (B, T + new), seconds, forward calls).
    The one timing of plain decoding, shared by bench and the demo."""
    with ForwardCounter(model) as counter, torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            **sampling,
        )
        seconds = time.perf_counter() - started
    return out, seconds, counter.count


class HFMethod:
    """Plain HF ``generate`` or its prompt-lookup variant, as a bench method. ``forms``: the forward
    forms its ``PackedLinear`` layers run packed (``draftheads.infer.packed.packed_forms``); None:
    as they were packed."""

    def __init__(
        self,
        name: str,
        model,
        tokenizer,
        prompt_lookup: int | None = None,
        forms: Iterable[str] | None = None,
    ):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_lookup = prompt_lookup
        self.forms = forms

    def run(
        self,
        prompts: list[BenchPrompt],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        batch_size: int | None = None,
    ) -> list[Sample]:
        """Decode the prompts together (left-padded when there are several), or in consecutive
        batches of ``batch_size``; one Sample per prompt."""
        if batch_size is not None and len(prompts) > batch_size:
            return [
                sample
                for index, batch in enumerate(consecutive_batches(prompts, batch_size))
                for sample in self.run(batch, max_new_tokens, temperature, seed + index)
            ]
        if self.prompt_lookup and len(prompts) > 1:
            raise BenchError("prompt lookup decodes one prompt at a time in transformers; use batch size 1")
        kwargs = _sampling_kwargs(temperature, seed)
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        stop = batch_stop_strings(prompts)
        if stop:  # transformers keeps the token completing a stop string, as our decoding does
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = max(p.input_ids.shape[1] for p in prompts)
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            length = prompt.input_ids.shape[1]
            ids[row, longest - length :] = prompt.input_ids[0]
            attention_mask[row, longest - length :] = 1
        ids, attention_mask = ids.to(self.model.device), attention_mask.to(self.model.device)
        scope = packed_forms(self.forms) if self.forms is not None else contextlib.nullcontext()
        with scope:
            out, seconds, forwards = timed_generate(
                self.model, ids, attention_mask, max_new_tokens, pad, **kwargs
            )
        eos = frozenset(_eos_ids(self.model, self.tokenizer))
        rule = StopRule(eos, stop, eos)
        samples = []
        for row, prompt in enumerate(prompts):
            # a finished row is padded after its EOS or stop string: cut where our decoding stops
            tokens, _ = rule.cut([], out[row, longest:].tolist(), max_new_tokens, self.tokenizer)
            samples.append(
                Sample(
                    self.name,
                    prompt.id,
                    prompt.category,
                    len(tokens),
                    seconds / len(prompts),
                    forwards,
                    tokens=tokens,
                    batch_size=len(prompts),
                )
            )
        return samples


class SpeculativeMethod:
    """draftheads decoding with one head, as a bench method.

    Suffix drafting also drafts from earlier answers (``generator.history``). Here a run drafts from
    the answers of the other prompts this pass decoded before it, never from the prompt's own: the
    warm-up and the repeats decode a prompt again, and its earlier answer would draft itself."""

    def __init__(self, name: str, generator):
        self.name = name
        self.generator = generator
        self.answers: dict[str, list[int]] = {}  # this pass's answers by prompt id, oldest first

    def start_pass(self) -> None:
        """Forget the answers decoded so far (the warm-up's, an earlier pass's)."""
        self.answers = {}

    def _load_history(self, prompts: list[BenchPrompt]) -> None:
        """The generator's history for a run of ``prompts``: the answers of this pass's other prompts."""
        history = self.generator.history
        if history is None:
            return
        history.clear()
        current = {prompt.id for prompt in prompts}
        for prompt_id, answer in self.answers.items():
            if prompt_id not in current:
                history.add(answer)

    def run(
        self,
        prompts: list[BenchPrompt],
        max_new_tokens: int,
        temperature: float,
        seed: int,
        batch_size: int | None = None,
    ) -> list[Sample]:
        """Decode the prompts together (one batch), or at most ``batch_size`` at once, each finished
        row replaced by the next prompt; one Sample per prompt."""
        self._load_history(prompts)
        result = self.generator.generate(
            [p.input_ids for p in prompts],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            batch_size=batch_size,
            stop=batch_stop_strings(prompts),
        )
        samples = []
        for prompt, row in zip(prompts, result.results):
            stats = row.stats
            samples.append(
                Sample(
                    self.name,
                    prompt.id,
                    prompt.category,
                    stats.new_tokens,
                    result.stats.seconds / len(prompts),
                    stats.forward_passes,
                    accepted_per_depth=list(stats.accepted_per_depth),
                    steps=stats.verification_steps,
                    tokens=row.new_tokens,
                    accepted_by_source=dict(stats.accepted_by_source),
                    batch_size=batch_size or len(prompts),
                )
            )
        if self.generator.history is not None:
            for prompt, row in zip(prompts, result.results):
                self.answers.pop(prompt.id, None)  # the newest answer last
                self.answers[prompt.id] = row.new_tokens
        return samples


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _median(runs: list[list[Sample]]) -> list[Sample]:
    """One method's repeated runs of a batch as one: the first run's samples with each prompt's
    median seconds (and every repeat's seconds, in order)."""
    samples = runs[0]
    for row, sample in enumerate(samples):
        sample.repeat_seconds = [run[row].seconds for run in runs]
        sample.seconds = statistics.median(sample.repeat_seconds)
    return samples


def run_bench(
    methods,
    prompts,
    max_new_tokens: int,
    temperature: float,
    repeats: int = 1,
    seed: int = 0,
    warmup_tokens: int = 16,
    progress: bool = True,
    batch_size: int = 1,
    continuous: bool = False,
    probe: Callable[[], float] | None = None,
    after_batch: Callable[[list[Sample]], None] | None = None,
) -> list[Sample]:
    """Decode every prompt with every method, interleaved batch by batch (``batch_size`` consecutive
    prompts at a time); the first method is the reference. ``continuous``: every method gets all
    the prompts in one run, with at most ``batch_size`` decoding at once (see the module).
    ``probe``: the machine's speed in seconds (``draftheads.speed_probe``), taken before the first
    run and after every run. A repeat of a batch (every method's run of it, back to back) is one
    unit: its samples keep the slowest probe around its runs, and units within ``QUIET_MARGIN`` of
    the fastest unit are flagged quiet. ``after_batch``: called with the samples so far after every
    batch (to save partial results). Greedy agreement is with the first method's output, or with
    that of the earlier method a method names in its ``agrees_with``."""
    from tqdm.auto import tqdm

    if continuous and batch_size > 1:
        batches, concurrency = [prompts], batch_size
    else:
        batches, concurrency = consecutive_batches(prompts, batch_size), None
    for method in methods:  # warm-up: allocator, kernels, caches; not timed
        method.run(batches[0], warmup_tokens, temperature, seed, concurrency)
        if isinstance(method, SpeculativeMethod):  # no warm-up answer in a suffix drafter's history
            method.start_pass()
    samples: list[Sample] = []
    last_probe = probe() if probe else None
    bar = tqdm(
        total=len(batches) * len(methods) * repeats,
        desc=f"bench (batch {batch_size})",
        unit="run",
        disable=not progress,
    )
    for index, batch in enumerate(batches):
        # Repeats alternate between the methods (a, b, a, b, ...), so that a slow spell of the
        # machine (a noisy neighbour on a shared host) falls on all of them, not on one method's runs.
        runs: list[list[list[Sample]]] = [[] for _ in methods]  # per method, its repeats
        unit_probes = []  # per repeat: the slowest probe around its runs
        for _ in range(repeats):
            around = [last_probe]
            for method, method_runs in zip(methods, runs):
                run = method.run(batch, max_new_tokens, temperature, seed + index, concurrency)
                method_runs.append(run)
                tokens, seconds = sum(s.new_tokens for s in run), sum(s.seconds for s in run)
                bar.set_postfix(method=method.name, tok_s=f"{tokens / max(seconds, 1e-9):.1f}")
                bar.update()
                if probe:
                    around.append(probe())
            last_probe = around[-1]
            if probe:
                unit_probes.append(max(around))
        by_method: dict[str, list[Sample]] = {}
        for method, method_runs in zip(methods, runs):
            batch_samples = _median(method_runs)
            for sample in batch_samples:  # the batch size asked for (the last batch may be smaller)
                sample.batch_size = batch_size
                sample.repeat_probe_seconds = list(unit_probes)
            by_method[method.name] = batch_samples
            # against the first method, or the earlier method it names (an engine's own plain run)
            reference = by_method[getattr(method, "agrees_with", None) or methods[0].name]
            if temperature <= 0:
                for sample, expected in zip(batch_samples, reference):
                    sample.agrees = sample.tokens == expected.tokens
            samples.extend(batch_samples)
        if after_batch is not None:
            after_batch(list(samples))
    bar.close()
    if probe and len(batches) * repeats > 1:
        limit = quiet_limit(min(p for s in samples for p in s.repeat_probe_seconds))
        for sample in samples:
            sample.quiet_repeats = [p <= limit for p in sample.repeat_probe_seconds]
    return samples


@dataclass(frozen=True)
class Summary:
    method: str
    category: str
    prompts: int
    tokens: int
    seconds: float
    tokens_per_second: float
    tau: float
    speedup: float
    implied_overhead: float  # tau / speedup: what a step costs relative to one plain decode step
    acceptance_by_depth: list[float]  # P(draft at depth d accepted) per decoding step
    agreement: float | None  # share of prompts identical to plain generate (T = 0)
    accepted_by_source: dict[str, float] = field(default_factory=dict)  # accepted drafts per step
    batch_size: int = 1
    # the speedup of each timed repeat alone (repeat r against the reference's repeat r, run next to
    # it): their spread is the machine's noise; empty with one repeat
    speedup_by_repeat: list[float] = field(default_factory=list)
    # the speedup over the quiet repeats alone (``Sample.quiet_repeats``) and how many runs of one
    # prompt they hold; None when the run flagged none
    quiet_speedup: float | None = None
    quiet_runs: int = 0
    reference: str = ""  # the method ``speedup`` and ``agreement`` are against
    # the speedup over the fastest plain ``generate`` of this category and batch size (which one:
    # ``fastest_plain``); None when the run timed no plain generate
    speedup_over_fastest_plain: float | None = None
    fastest_plain: str | None = None


def summarize(samples: list[Sample], reference_method: str) -> list[Summary]:
    """Per (method, category) and per method overall ('all'), for samples of one batch size; every
    plain ``generate`` among them (``is_plain``) competes for ``fastest_plain``."""
    batch_size = samples[0].batch_size if samples else 1
    groups: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for sample in samples:
        groups[(sample.method, sample.category)].append(sample)
        groups[(sample.method, "all")].append(sample)
    rates, repeat_rates, quiet_rates, quiet_counts = {}, {}, {}, {}
    for key, group in groups.items():
        rates[key] = sum(s.new_tokens for s in group) / max(sum(s.seconds for s in group), 1e-9)
        quiet = [
            (s.new_tokens, s.repeat_seconds[r]) for s in group for r, q in enumerate(s.quiet_repeats) if q
        ]
        if quiet:
            quiet_rates[key] = sum(t for t, _ in quiet) / max(sum(t for _, t in quiet), 1e-9)
            quiet_counts[key] = len(quiet)
        repeats = {len(s.repeat_seconds) for s in group}
        if len(repeats) == 1 and min(repeats) > 1:
            tokens = sum(s.new_tokens for s in group)
            repeat_rates[key] = [
                tokens / max(sum(s.repeat_seconds[r] for s in group), 1e-9) for r in range(min(repeats))
            ]
    fastest_plain = {}  # category -> the plain method with the highest rate
    for (method, category), rate in rates.items():
        best = fastest_plain.get(category)
        if is_plain(method) and (best is None or rate > rates[(best, category)]):
            fastest_plain[category] = method
    summaries = []
    for (method, category), group in groups.items():
        fastest = fastest_plain.get(category)
        tokens = sum(s.new_tokens for s in group)
        forwards = sum(s.forwards for s in group)
        tau = tokens / max(forwards, 1)
        speedup = rates[(method, category)] / rates[(reference_method, category)]
        own = repeat_rates.get((method, category), [])
        against = repeat_rates.get((reference_method, category), [])
        by_repeat = [a / b for a, b in zip(own, against)] if len(own) == len(against) else []
        # every method ran each repeat next to the others, so the quiet runs are the same for all
        quiet_speedup, quiet_runs = None, quiet_counts.get((method, category), 0)
        if quiet_runs and (reference_method, category) in quiet_rates:
            quiet_speedup = quiet_rates[(method, category)] / quiet_rates[(reference_method, category)]
        steps = sum(s.steps for s in group)
        depth = max((len(s.accepted_per_depth) for s in group), default=0)
        acceptance = [
            sum(s.accepted_per_depth[d] for s in group if d < len(s.accepted_per_depth)) / max(steps, 1)
            for d in range(depth)
        ]
        agreement = None
        if all(s.agrees is not None for s in group):
            agreement = sum(bool(s.agrees) for s in group) / len(group)
        by_source: dict[str, float] = defaultdict(float)
        for sample in group:
            for source, count in sample.accepted_by_source.items():
                by_source[source] += count / max(steps, 1)
        summaries.append(
            Summary(
                method,
                category,
                len(group),
                tokens,
                sum(s.seconds for s in group),
                rates[(method, category)],
                tau,
                speedup,
                tau / speedup if speedup else float("nan"),
                acceptance,
                agreement,
                dict(sorted(by_source.items())),
                batch_size,
                by_repeat,
                quiet_speedup,
                quiet_runs,
                reference_method,
                rates[(method, category)] / rates[(fastest, category)] if fastest else None,
                fastest,
            )
        )
    summaries.sort(key=lambda s: (s.category != "all", s.category, s.method))
    return summaries


def markdown_table(summaries: list[Summary]) -> str:
    batched = any(s.batch_size > 1 for s in summaries)
    batch_header, batch_rule = (" batch |", "---:|") if batched else ("", "")
    probed = any(s.quiet_speedup is not None for s in summaries)
    quiet_header, quiet_rule = (" quiet speedup (runs) |", "---:|") if probed else ("", "")
    lines = [
        (
            f"| category | method |{batch_header} tau | tokens/s | speedup | over fastest plain (which) |"
            f"{quiet_header} overhead (tau/speedup) | acceptance by depth | accepted per step by source | "
            "agreement |"
        ),
        f"|---|---|{batch_rule}---:|---:|---:|---:|{quiet_rule}---:|---|---|---:|",
    ]
    for s in summaries:
        acceptance = " / ".join(f"{a:.2f}" for a in s.acceptance_by_depth) or "-"
        by_source = ", ".join(f"{source} {rate:.2f}" for source, rate in s.accepted_by_source.items()) or "-"
        agreement = "-" if s.agreement is None else f"{s.agreement:.0%}"
        batch = f" {s.batch_size} |" if batched else ""
        spread = ""
        if s.speedup_by_repeat:
            spread = f" ({min(s.speedup_by_repeat):.2f}-{max(s.speedup_by_repeat):.2f})"
        quiet = ""
        if probed:
            quiet = " - |" if s.quiet_speedup is None else f" {s.quiet_speedup:.2f}x ({s.quiet_runs}) |"
        over_plain = "-"
        if s.speedup_over_fastest_plain is not None:
            over_plain = f"{s.speedup_over_fastest_plain:.2f}x ({s.fastest_plain})"
        lines.append(
            f"| {s.category} | {s.method} |{batch} {s.tau:.2f} | {s.tokens_per_second:.1f} | "
            f"{s.speedup:.2f}x{spread} | {over_plain} |{quiet} {s.implied_overhead:.2f} | {acceptance} | "
            f"{by_source} | {agreement} |"
        )
    return "\n".join(lines) + "\n"


def plot(summaries: list[Summary], files: ResultFiles) -> list[Path]:
    """speedup_by_category.png and acceptance_by_depth.png (and throughput_by_batch.png for several
    batch sizes), written through ``files`` (never over a file bench did not write); none (and a
    warning) where matplotlib is not installed."""
    if not available("matplotlib"):
        warnings.warn("matplotlib is not installed: no bench charts (pip install 'draftheads[plots]')")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if len({s.batch_size for s in summaries}) > 1:
        written.append(_plot_batches(plt, summaries, files))
    summaries = [s for s in summaries if s.batch_size == min(x.batch_size for x in summaries)]
    methods = sorted(
        {s.method for s in summaries if s.method != s.reference}
    )  # the reference: the line at 1.0
    categories = sorted({s.category for s in summaries}, key=lambda c: (c == "all", c))
    width_inches = min(14.0, max(6.0, 0.18 * len(categories) * max(1, len(methods)) + 2.0))
    fig, ax = plt.subplots(figsize=(width_inches, 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [
            next((s.speedup for s in summaries if s.method == method and s.category == c), 0)
            for c in categories
        ]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(
        [x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=30
    )
    ax.set_ylabel(f"speedup over {summaries[0].reference or PLAIN} (line: 1.0)")
    ax.legend(fontsize=8, ncol=min(4, max(1, len(methods))), loc="upper left")
    fig.tight_layout()
    written.append(files.save_chart(SPEEDUP_CHART, lambda path: fig.savefig(path, dpi=120)))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        if s.category == "all" and s.acceptance_by_depth:
            ax.plot(
                range(1, len(s.acceptance_by_depth) + 1), s.acceptance_by_depth, marker="o", label=s.method
            )
    ax.set_xlabel("draft depth")
    ax.set_ylabel("P(accepted) per decoding step")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:  # no drafting method measured acceptance: no legend
        ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(files.save_chart(ACCEPTANCE_CHART, lambda path: fig.savefig(path, dpi=120)))
    plt.close(fig)
    return written


def _plot_batches(plt, summaries: list[Summary], files: ResultFiles) -> Path:
    """throughput_by_batch.png: tokens/s over the batch and speedup over batched generate, by batch size."""
    overall = [s for s in summaries if s.category == "all"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method in sorted({s.method for s in overall}):
        points = sorted((s.batch_size, s.tokens_per_second, s.speedup) for s in overall if s.method == method)
        sizes = [p[0] for p in points]
        left.plot(sizes, [p[1] for p in points], marker="o", label=method)
        right.plot(sizes, [p[2] for p in points], marker="o", label=method)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch size")
    left.set_ylabel("generated tokens/s (whole batch)")
    right.set_ylabel("speedup over batched generate")
    right.axhline(1.0, color="grey", linewidth=0.8)
    left.legend(fontsize=8)
    fig.tight_layout()
    path = files.save_chart(BATCH_CHART, lambda target: fig.savefig(target, dpi=120))
    plt.close(fig)
    return path


def probe_summary(samples: list[Sample]) -> ProbeSummary | None:
    """The probes of these samples' repeats, taken once per repeat (the reference's samples hold them
    as every method's do); None without probes."""
    reference = samples[0].method if samples else None  # the first method's samples come first
    return summarize_probes([p for s in samples if s.method == reference for p in s.repeat_probe_seconds])


def probe_note(samples: list[Sample]) -> str:
    """bench.md's paragraph on the machine's speed during the run, per batch size ('' without probes)."""
    by_batch: dict[int, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_batch[sample.batch_size].append(sample)
    summaries = {size: probe_summary(group) for size, group in sorted(by_batch.items())}
    lines = [f"batch {size}: {summary.describe()}" for size, summary in summaries.items() if summary]
    if not lines:
        return ""
    return (
        "Machine speed: a one-token forward of the base timed between the methods' runs; each repeat "
        "of a batch (every method's run of it) counts the slowest probe around it, one figure per "
        "prompt and repeat. Another tenant's load slows memory-bound plain decoding and a speculative "
        "step unequally, so a slow spell moves the speedups; 'quiet speedup' keeps only the runs "
        f"whose repeat was within {QUIET_MARGIN:.0%} of the fastest (draftheads/speed_probe.py). "
        + "; ".join(lines)
        + ".\n\n"
    )


def results_json(samples, summaries, info: dict, settings: dict, partial: bool) -> str:
    """bench.json's text; ``partial``: the run has not finished (an interrupted run keeps these)."""
    record = {
        "partial": partial,
        "tau_convention": TAU_CONVENTION,
        "machine": info,
        "settings": settings,
        "summaries": [asdict(s) for s in summaries],
        "samples": [{k: v for k, v in asdict(s).items() if k != "tokens"} for s in samples],
    }
    return json.dumps(record, indent=2) + "\n"


def results_markdown(samples, summaries, info: dict, settings: dict, partial: bool) -> str:
    header = "**Partial results: the run has not finished.**\n\n" if partial else ""
    header += (
        f"Settings: {json.dumps(settings)}\n\nMachine: {json.dumps(info)}\n\ntau = {TAU_CONVENTION}.\n\n"
    )
    if summaries:
        plain = sorted({s.method for s in summaries if is_plain(s.method)})
        header += (
            f"speedup: over {summaries[0].reference}; over fastest plain: over the fastest plain decoding "
            f"of the same category and batch size in this run (of {', '.join(plain)}), named in brackets.\n\n"
        )
    if any(s.speedup_by_repeat for s in summaries):
        header += (
            "speedup: from each batch's median time over the repeats; in brackets the lowest and "
            "highest speedup of one whole pass (repeat r of every batch against the reference's "
            "repeat r, run next to it): the machine's noise. The medians are taken batch by batch, "
            "so the first figure can lie outside that range.\n\n"
        )
    header += probe_note(samples)
    if settings.get("engine"):
        from draftheads.bench_engines import engine_note

        header += engine_note(settings["engine"])
    if settings.get("continuous") and any(s.batch_size > 1 for s in summaries):
        header += (
            "batch B > 1: the draftheads methods decode every prompt in one run, at most B at once, "
            "each finished row replaced by the next prompt; generate runs consecutive batches of B. "
            "Every prompt's time is its run's shared evenly, so categories do not differ in speed.\n\n"
        )
    return header + markdown_table(summaries)


def write_results(
    samples,
    summaries,
    info: dict,
    settings: dict,
    out_dir: Path,
    files: ResultFiles | None = None,
    partial: bool = False,
) -> list[Path]:
    """Write bench.json and bench.md through ``files`` (default: new ones in ``out_dir``), and the
    charts once the run is complete; returns the paths written."""
    files = files or ResultFiles(out_dir)
    paths = files.write(
        results_json(samples, summaries, info, settings, partial),
        results_markdown(samples, summaries, info, settings, partial),
    )
    if partial:
        return paths
    return [*paths, *plot(summaries, files)]


# ---- prompts, heads and the whole job ------------------------------------------------------------


def build_prompts(
    name: str,
    tokenizer,
    limit: int | None,
    categories: list[str] | None = None,
    template: str = DEFAULT_TEMPLATE,
) -> list[BenchPrompt]:
    """First turns of an eval set, rendered by ``template`` (``draftheads.prompt_format``: the base
    model's chat template, or plain dialogue text for a base without one)."""
    from draftheads.data.prompts import load_prompts

    items = load_prompts(name)
    known = {item.category for item in items}
    unknown = sorted(set(categories or ()) - known)
    if unknown:
        raise BenchError(
            f"--categories: {name} has no {', '.join(repr(c) for c in unknown)}; "
            f"its categories: {', '.join(sorted(known))}"
        )
    chosen = choose_template(template, tokenizer, "--template")
    prompts = []
    for item in items:
        if categories and item.category not in categories:
            continue
        ids = prompt_ids(tokenizer, [{"role": "user", "content": item.turns[0]}], chosen)
        prompts.append(BenchPrompt(str(item.id), item.category, torch.tensor([ids]), stop_strings(chosen)))
    if not prompts:
        raise BenchError(f"--prompts {name}: no prompts")
    if limit:
        prompts = _spread(prompts, limit)
    return prompts


def _spread(prompts: list[BenchPrompt], limit: int) -> list[BenchPrompt]:
    """Up to ``limit`` prompts, taken round-robin over categories so every category is present."""
    by_category: dict[str, list[BenchPrompt]] = defaultdict(list)
    for prompt in prompts:
        by_category[prompt.category].append(prompt)
    chosen: list[BenchPrompt] = []
    queues = [list(v) for v in by_category.values()]
    while len(chosen) < limit and any(queues):
        for queue in queues:
            if queue and len(chosen) < limit:
                chosen.append(queue.pop(0))
    return chosen


class BenchError(ValueError):
    """Bench settings that cannot run; the message names the setting and value."""


def bench_tree(tree: str | None, head_dir: str, model):
    """``--tree``: a registered name, a tuned-tree file, or (None) the head's own tuned tree for this
    device and dtype (``draftheads tune-tree``); None again means the generator's default."""
    from draftheads.infer.tree import load_tuned_tree, tuned_tree_key

    if tree is None:
        return load_tuned_tree(head_dir, model.dtype, model.device)
    if tree.endswith(".json"):
        tuned = load_tuned_tree(tree, model.dtype, model.device)
        if tuned is None:
            raise BenchError(
                f"--tree {tree}: holds no tree tuned for {tuned_tree_key(model.dtype, model.device)}"
            )
        return tuned
    return tree


def method_name(kind: str, head_dir: str, methods: list, draft_dtype: str | None = None) -> str:
    """``kind:label``: the head directory's name, or its run's name for the ``<run>/head`` that
    training writes, with ``@<dtype>`` when ``draft_dtype`` is given (a head benched in several);
    a repeated label gets a ``#n`` suffix so every method stays distinct."""
    path = Path(head_dir).resolve()
    label = path.parent.name if path.name == "head" else path.name
    if draft_dtype is not None:
        label += "@" + draft_dtype
    base = name = f"{kind}:{label}"
    taken = {method.name for method in methods}
    copies = 1
    while name in taken:
        copies += 1
        name = f"{base}#{copies}"
    return name


def speculative_methods(
    head_dirs,
    model,
    tokenizer,
    tree: str | None,
    device,
    pack: bool = False,
    context_only: bool = False,
    hybrid: bool = False,
    suffix: bool = False,
    adaptive: bool = False,
    keep: Callable[[str], bool] = lambda name: True,
    draft_dtypes: tuple[str, ...] = (DEFAULT_DRAFT_DTYPE,),
    forms: Iterable[str] = FORMS,
) -> list:
    """One ``SpeculativeMethod`` per head directory, each on the model it drafts for: ``model`` itself,
    or for a joint (Medusa-2) head an adapted copy of it (``load_head_and_base``), so the baselines and
    the other heads keep the original base. ``pack``: prepack the linear layers of ``model`` and of
    every adapted copy (after the merge), running packed for the forward ``forms``
    (``draftheads.infer.kernel_choice``), and those of every head when ``forms`` has any.
    ``context_only``: also the context drafter with no head (``context``); ``hybrid``: also each head
    with context drafts merged into its trees (``<kind>+context:<label>``); ``suffix``: also suffix
    drafts (``draftheads.infer.suffix``) alone (``suffix``) and merged into each head's trees
    (``<kind>+suffix:<label>``); ``adaptive``: each of these also with adaptive drafting
    (``.../adaptive``), and for a head directory holding a fitted acceptance head
    (``draftheads fit-confidence``) with adaptive drafting priced by it (``.../adaptive/confidence``).
    ``keep``: which method names to build.
    ``draft_dtypes``: each head loaded once per dtype it drafts in (``draftheads.infer.precision``);
    with more than one, method names say which (``eagle3:run@bfloat16``)."""
    from draftheads.heads import load_head_and_base
    from draftheads.heads.base import resolve_head_dir
    from draftheads.infer import SpeculativeGenerator
    from draftheads.infer.confidence import CONFIDENCE_CONFIG, load_confidence
    from draftheads.infer.packed import pack_linears, set_packed_forms
    from draftheads.infer.suffix import SuffixTree
    from draftheads.infer.verify_cost import load_tuned_costs

    forms = frozenset(forms)
    pack_heads = pack and bool(forms)
    head_dirs = [resolve_head_dir(d) for d in head_dirs]  # a training run's output directory: its head/
    loaded = []  # (head_dir, head, the model it drafts for, its draft dtype)
    for head_dir in head_dirs:
        for requested in draft_dtypes:
            head, head_model = load_head_and_base(head_dir, model, map_location=device)
            loaded.append((head_dir, head, head_model, prepare_head(head, head_model, requested, pack_heads)))
    if pack:
        bases = [model, *(head_model for _, _, head_model, _ in loaded)]
        pack_linears(*bases)
        set_packed_forms(*bases, forms=forms)
    if pack_heads:
        pack_linears(*(head for _, head, _, _ in loaded))
    variants = (False, True) if adaptive else (False,)
    methods: list = []
    alone = ([None] if context_only else []) + ([SuffixTree()] if suffix else [])  # None: context drafts
    merged = [False] + ([True] if hybrid else []) + ([SuffixTree()] if suffix else [])
    for text in alone:
        for is_adaptive in variants:
            generator = SpeculativeGenerator(model, None, tokenizer, tree=text, adaptive=is_adaptive)
            if keep(generator.method):
                methods.append(SpeculativeMethod(generator.method, generator))
    for head_dir, head, head_model, dtype in loaded:
        # with adaptive drafting: priced by the calibration, and by a fitted acceptance head too
        fitted = adaptive and (Path(head_dir) / CONFIDENCE_CONFIG).is_file()
        pricing = [(False, None)] + ([(True, None)] if adaptive else [])
        pricing += [(True, load_confidence(head_dir))] if fitted else []
        for with_context in merged:
            for is_adaptive, acceptance in pricing:
                costs = load_tuned_costs(head_dir, head_model.dtype, head_model.device) if is_adaptive else {}
                generator = SpeculativeGenerator(
                    head_model,
                    head,
                    tokenizer,
                    tree=bench_tree(tree, head_dir, head_model),
                    context=with_context,
                    adaptive=is_adaptive,
                    cost=costs.get(1),
                    confidence=acceptance,
                )
                generator.batch_costs.update(costs)  # tune-tree's curves, when measured on this machine
                if keep(generator.method):
                    methods.append(
                        SpeculativeMethod(
                            method_name(
                                generator.method, head_dir, methods, dtype if len(draft_dtypes) > 1 else None
                            ),
                            generator,
                        )
                    )
    return methods


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before anything runs, an ``--out`` the results could not be written to, or one that
    holds an earlier run's results (unless ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise BenchError(f"--out {out}: exists and is not a directory")
    earlier = [out / name for name in RESULT_FILES if (out / name).exists()]
    if earlier and not overwrite:
        raise BenchError(
            f"--out {out}: holds an earlier run's results ({', '.join(p.name for p in earlier)}); "
            "pass --overwrite to replace them or choose another --out"
        )
    if out.is_dir():
        check_charts(out)  # a chart of the same name a run would write, not written by bench


def check_methods(requested: tuple[str, ...] | None, offered: set[str]) -> None:
    """Every ``--methods`` name is one this run can build (before the timed runs start)."""
    unknown = sorted(set(requested or ()) - offered)
    if unknown:
        raise BenchError(
            f"--methods: no method {', '.join(repr(m) for m in unknown)} in this run; "
            f"available: {', '.join(sorted(offered))}"
        )


def plain_baselines(model, tokenizer, packable: bool) -> list[HFMethod]:
    """Plain HF ``generate`` in every way this machine offers, the reference first: on a CPU in fp32,
    ``generate@fp32-default`` (PyTorch's default kernels), ``generate@fp32-packed`` (oneDNN prepacked
    weights, where ``packable``) and ``generate@bf16`` (a bf16 copy of the model, where the CPU has
    native bf16); elsewhere ``generate@<dtype>``. Call it before ``model`` is packed."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype, "other")
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return [HFMethod(f"{PLAIN}@{short}", model, tokenizer, forms=())]
    methods = [HFMethod(f"{PLAIN}@fp32-default", model, tokenizer, forms=())]
    if packable:
        methods.append(HFMethod(f"{PLAIN}@fp32-packed", model, tokenizer, forms=FORMS))
    if native_bf16():
        methods.append(HFMethod(f"{PLAIN}@bf16", copy.deepcopy(model).to(torch.bfloat16), tokenizer))
    return methods


def check_settings(settings: BenchSettings) -> None:
    """Refuse, before anything loads, settings the run could not use (the timed runs take hours)."""
    from draftheads.infer.kernel_choice import check_pack
    from draftheads.infer.tree import TREES

    if not settings.batch_sizes or min(settings.batch_sizes) < 1:
        raise BenchError(f"batch sizes must be >= 1, got {list(settings.batch_sizes)}")
    if settings.base is None and not settings.heads:
        raise BenchError(
            "give a base model (--base) or at least one head directory (--heads) to read it from"
        )
    if settings.tree is not None and not settings.tree.endswith(".json") and settings.tree not in TREES:
        raise BenchError(
            f"--tree {settings.tree}: not a tree name ({', '.join(sorted(TREES))}) or a .json file"
        )
    try:
        check_pack(settings.pack)
    except ValueError as err:
        raise BenchError(f"--pack: {err}") from None
    check_out(Path(settings.out), settings.overwrite)


def build_methods(settings: BenchSettings, model, tokenizer) -> tuple[list, str]:
    """Every method of the run, the plain baselines first, and how the kernels were chosen; refuses
    unknown ``--methods`` names."""
    from draftheads.infer.kernel_choice import choose_kernels
    from draftheads.infer.packed import packing_supported, unpack_linears

    kernels = choose_kernels(model, settings.pack)  # measured once per machine, then cached
    unpack_linears(model)  # copies (bf16, adapted bases) are made from the plain model
    packable = packing_supported(model)
    methods = plain_baselines(model, tokenizer, packable)
    offered = {m.name for m in methods} | ({"prompt-lookup"} if settings.prompt_lookup else set())

    def keep(name: str) -> bool:
        offered.add(name)
        return settings.methods is None or name in settings.methods

    heads = speculative_methods(
        settings.heads,
        model,
        tokenizer,
        settings.tree,
        settings.device,
        pack=packable,
        context_only=settings.context,
        hybrid=settings.hybrid,
        suffix=settings.suffix,
        adaptive=settings.adaptive,
        keep=keep,
        draft_dtypes=settings.draft_dtypes,
        forms=kernels.packed,
    )
    check_methods(settings.methods, offered)
    if settings.prompt_lookup and (settings.methods is None or "prompt-lookup" in settings.methods):
        # on the chosen kernels, as the drafting methods (it verifies several tokens a step too)
        methods.append(HFMethod("prompt-lookup", model, tokenizer, prompt_lookup=PROMPT_LOOKUP_TOKENS))
    return methods + heads, kernels.describe()


def bench(
    settings: BenchSettings, progress: bool = True, engine: EngineSettings | None = None
) -> tuple[list[Summary], list[Path]]:
    """Run every method on the same prompts, interleaved, at each of ``settings.batch_sizes``; write
    bench.json and bench.md to ``settings.out`` after every batch (``"partial": true`` until the
    last) and the charts at the end; return the summaries and the files written. ``engine``: also
    the engine's rows (``draftheads.bench_engines``), its servers up for the run."""
    from draftheads.base_model import load_base, resolve_dtype
    from draftheads.heads import resolve_base_model

    check_settings(settings)
    settings = replace(settings, device=str(check_device(settings.device)))  # "auto" named for the record
    if engine is not None:
        from draftheads.bench_engines import check_engine, engine_methods, with_engine_defaults

        check_engine(engine, settings)
        settings = with_engine_defaults(settings)
    base_name = resolve_base_model(settings.heads[0], settings.base) if settings.heads else settings.base
    model, tokenizer = load_base(base_name, dtype=settings.dtype, device=settings.device)
    methods, kernels = build_methods(settings, model, tokenizer)
    prompts = build_prompts(
        settings.prompts, tokenizer, settings.limit, settings.categories, settings.template
    )
    record = {**asdict(settings), "base": base_name, "kernels": kernels}
    info = machine_info(resolve_dtype(settings.dtype, settings.device), settings.device)
    files = claim_out(Path(settings.out), settings.overwrite, info, record)
    with contextlib.ExitStack() as servers:  # an engine's servers stop however the run ends
        if engine is not None:
            logs = files.out / "engine-logs"
            engine_rows, record["engine"] = servers.enter_context(
                engine_methods(engine, settings, base_name, logs, tokenizer)
            )
            methods = methods + engine_rows
        if progress:
            print(
                f"bench: {len(prompts)} prompts x {len(methods)} methods, "
                f"max_new_tokens={settings.max_new_tokens}, "
                f"T={settings.temperature}, {settings.dtype} on {settings.device}; drafting methods' linear "
                f"kernels: {kernels}"
                + (f", batch sizes {list(settings.batch_sizes)}" if settings.batch_sizes != (1,) else "")
            )
        samples, summaries = run_batch_sizes(settings, methods, prompts, model, info, record, files, progress)
    paths = write_results(samples, summaries, info, record, files.out, files)
    if settings.overwrite:
        files.remove_stale_charts(paths)
    return summaries, paths


def run_batch_sizes(
    settings: BenchSettings, methods, prompts, model, info: dict, record: dict, files, progress: bool
) -> tuple[list[Sample], list[Summary]]:
    """``run_bench`` at each of ``settings.batch_sizes``, saving partial results after every
    batch; every sample and every batch size's summaries."""
    samples, summaries = [], []
    reference = methods[0].name

    def save_partial(batch_samples: list[Sample]) -> None:
        partial = summaries + summarize(batch_samples, reference_method=reference)
        write_results(samples + batch_samples, partial, info, record, files.out, files, partial=True)

    for batch_size in settings.batch_sizes:
        # transformers' prompt lookup decodes one sequence at a time
        batch_methods = [m for m in methods if batch_size == 1 or not getattr(m, "prompt_lookup", None)]
        batch_samples = run_bench(
            batch_methods,
            prompts,
            settings.max_new_tokens,
            settings.temperature,
            settings.repeats,
            settings.seed,
            progress=progress,
            batch_size=batch_size,
            continuous=settings.continuous,
            probe=lambda: forward_seconds(model, prompts[0].input_ids[:, -1:]),
            after_batch=save_partial,
        )
        probes = probe_summary(batch_samples)
        if progress and probes and probes.median > probes.quiet_limit:
            print(
                f"bench (batch {batch_size}): the machine slowed during the run (a one-token forward: "
                f"{probes.describe()}); see the quiet speedups in bench.md"
            )
        samples += batch_samples
        summaries += summarize(batch_samples, reference_method=reference)
    return samples, summaries


def claim_out(out: Path, overwrite: bool, info: dict, record: dict) -> ResultFiles:
    """Create ``--out`` and claim its bench.json / bench.md (``draftheads.bench_output``) before the
    timed runs: an unwritable directory fails now, not after them."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise BenchError(f"--out {out}: cannot create it ({err.strerror})") from None
    if not os.access(out, os.W_OK):
        raise BenchError(f"--out {out}: not writable")
    files = ResultFiles(out)
    files.claim(
        overwrite,
        results_json([], [], info, record, partial=True),
        results_markdown([], [], info, record, partial=True),
    )
    return files
