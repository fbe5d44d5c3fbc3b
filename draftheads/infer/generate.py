"""Lossless speculative decoding: the decode loop and its public API.

Read top to bottom: the statistics, the decode loop's state, and ``SpeculativeGenerator``: its
decode loop (``_decode``, the only loop over decoding steps in the package: start rows, plan the
step, draft, verify, accept, record) and its public ``generate`` and ``from_pretrained``.

One step: a Drafter proposes a tree (``draft.py``: a head's, the context's, or both merged); the
unmodified Hugging Face model verifies every node in ONE forward through a 4D additive mask with
explicit positions (``forward.py``, ``tree.py``); a
verifier (``verify.py``) keeps the longest valid path plus the base model's own next token; the KV
cache keeps only the accepted entries (``cache.py``). A batch runs the same step for every row at
once: one tree per row, one forward, each row advancing by what it accepted. Greedy decoding in
fp32 reproduces ``model.generate(do_sample=False)`` token for token, row by row; sampling follows
the base model's distribution.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from draftheads.base_model import DEFAULT_DTYPE
from draftheads.device import DEFAULT_DEVICE
from draftheads.infer.adaptive import (
    AdaptiveDrafter,
    Calibration,
    HeadGate,
    common_tree_size,
    likeliest_nodes,
    prune_draft,
)
from draftheads.infer.batch_draft import propose_rows
from draftheads.infer.cache import add_rows, keep_accepted_rows, left_aligned_slots, select_rows
from draftheads.infer.confidence import NEEDS_ADAPTIVE, load_confidence
from draftheads.infer.context import ContextDrafter, ContextTree
from draftheads.infer.draft import Draft, Drafter, drafter_for
from draftheads.infer.forward import SUPPORTED_ATTENTION, TreeInputError, prefill_rows, rows_forward
from draftheads.infer.hybrid import HybridDrafter, HybridTree
from draftheads.infer.inputs import PromptError, messages_prompt_ids
from draftheads.infer.kernel_choice import DEFAULT_PACK, choose_kernels, prepare_drafting_head
from draftheads.infer.limits import TreeFitError, check_tree_fits, draft_vocabulary_size
from draftheads.infer.packed import has_packed_linears, packed_description
from draftheads.infer.precision import DEFAULT_DRAFT_DTYPE
from draftheads.infer.step_gate import StepGate
from draftheads.infer.stopping import StopRule
from draftheads.infer.suffix import SuffixDrafter, SuffixHistory, SuffixTree
from draftheads.infer.tree import TUNED_TREE_FILE, load_tuned_tree, padded_size, resolve_tree, tuned_tree_key
from draftheads.infer.verify import Acceptance, SamplingParams, next_token, verify_tree
from draftheads.infer.verify_cost import CostCurve, load_tuned_costs, measure_verify_cost
from draftheads.prompt_format import DEFAULT_TEMPLATE, check_template, choose_template, stop_strings

if TYPE_CHECKING:
    from transformers import DynamicCache

DEFAULT_MAX_NEW_TOKENS = 256
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes adaptive drafting measures
# What ``from_pretrained`` and ``draftheads generate`` draft with unless told otherwise: a head's
# tree with context drafts merged in, adaptive, the fastest of the drafting methods benchmarked
# (docs/benchmarks.md, "Drafting methods on single prompts"); adaptive drafting also makes an
# untrained head cost least. The constructor drafts exactly as it is told: the head alone by default.
RECOMMENDED_CONTEXT = True
RECOMMENDED_ADAPTIVE = True
# Suffix drafts (``draftheads.infer.suffix``, which also match earlier answers) in place of the
# context drafter's: off until benchmarked against it (``draftheads bench --suffix``).
RECOMMENDED_SUFFIX = False


# ---- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationStats:
    """What one ``generate`` call did.

    tau, the mean accepted length, counts the token the base model produces itself at each
    verification step: a step that accepts d draft tokens emits d + 1 tokens, so tau = 1 without a
    head and tau <= depth + 1 (EAGLE counts this way, Li et al. 2024; some engines do not).
    tau is measured over verification forwards (the prefill forward is not one) before truncation
    at EOS or max_new_tokens; it is NaN when no verification step ran. ``finish_reason``: why the
    sequence ended (``draftheads.infer.stopping.FINISH_REASONS``: eos, stop, length, context).
    """

    new_tokens: int
    verification_steps: int  # tree forwards of the base model
    forward_passes: int  # base-model forwards: the prefill + one per verification step
    accepted_per_depth: tuple[int, ...]  # steps that accepted a draft token at depth 1, 2, ...
    tau: float
    seconds: float
    tokens_per_second: float
    tree: str  # the tree used
    # draft tokens accepted / proposed, by who proposed them ("eagle3", "context", "eagle3+context")
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    proposed_by_source: dict[str, int] = field(default_factory=dict)
    finish_reason: str | None = None  # None only while the sequence goes on
    # the base's linear kernels by forward form (``draftheads.infer.kernel_choice``)
    kernels: str = ""

    def summary(self) -> str:
        by_source = ""
        if len(self.proposed_by_source) > 1:
            by_source = "; accepted drafts by source: " + ", ".join(
                f"{source} {self.accepted_by_source.get(source, 0)}/{proposed}"
                for source, proposed in sorted(self.proposed_by_source.items())
            )
        return (
            f"tau {self.tau:.2f} (accepted tokens per base forward, the base model's own token included), "
            f"{self.tokens_per_second:.1f} tokens/s, {self.new_tokens} tokens in {self.seconds:.2f} s"
            + by_source
            + (f"; finish reason: {self.finish_reason}" if self.finish_reason else "")
        )


@dataclass
class _Tally:
    """Counters the decode loop fills in (one per ``generate`` call)."""

    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None  # when the sequence stopped (a batch goes on without it)
    finish_reason: str | None = None  # why it stopped (``stopping.FINISH_REASONS``)
    new_tokens: int = 0
    verification_steps: int = 0
    emitted_by_steps: int = 0  # sum over steps of accepted drafts + 1
    accepted_per_depth: list[int] = field(default_factory=list)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    proposed_by_source: dict[str, int] = field(default_factory=dict)

    def record_sources(self, sources: Sequence[str], accepted_nodes: Sequence[int]) -> None:
        """Count the step's proposals (node 0, the root, is nobody's draft) and accepted drafts."""
        for source in sources[1:]:
            self.proposed_by_source[source] = self.proposed_by_source.get(source, 0) + 1
        for node in accepted_nodes[1:]:
            self.accepted_by_source[sources[node]] = self.accepted_by_source.get(sources[node], 0) + 1

    def record_step(self, accepted_drafts: int) -> None:
        self.verification_steps += 1
        self.emitted_by_steps += accepted_drafts + 1
        while len(self.accepted_per_depth) < accepted_drafts:
            self.accepted_per_depth.append(0)
        for depth in range(accepted_drafts):
            self.accepted_per_depth[depth] += 1

    def finish(self, reason: str) -> None:
        self.finished = time.perf_counter()
        self.finish_reason = reason

    def stats(self, tree_name: str, kernels: str = "") -> GenerationStats:
        seconds = (self.finished or time.perf_counter()) - self.started
        steps = self.verification_steps
        return GenerationStats(
            new_tokens=self.new_tokens,
            verification_steps=steps,
            forward_passes=steps + 1,
            accepted_per_depth=tuple(self.accepted_per_depth),
            tau=self.emitted_by_steps / steps if steps else float("nan"),
            seconds=seconds,
            tokens_per_second=self.new_tokens / seconds if seconds > 0 else float("inf"),
            tree=tree_name,
            accepted_by_source=dict(self.accepted_by_source),
            proposed_by_source=dict(self.proposed_by_source),
            finish_reason=self.finish_reason,
            kernels=kernels,
        )


@dataclass(frozen=True)
class GenerationResult:
    """``sequences``: (1, prompt + new) token ids; ``text``: the new tokens decoded (with a tokenizer)."""

    sequences: torch.Tensor
    prompt_length: int
    stats: GenerationStats
    text: str | None = None

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_length :].tolist()

    @property
    def finish_reason(self) -> str | None:
        """Why the sequence ended: eos, stop, length or context (``draftheads.infer.stopping``)."""
        return self.stats.finish_reason


@dataclass(frozen=True)
class BatchStats:
    """What one ``generate`` call on a batch did, over all its rows (each row's own
    ``GenerationStats`` is in its result). ``batch_size``: the rows (prompts) decoded;
    ``verification_steps``: the most verification forwards one row took part in (with every row
    decoding at once, the batched forwards after the prefill); tau: tokens emitted per row and
    verification forward, over all rows' steps; ``seconds``: from the first row's prefill to the
    last row's stop; ``finish_reasons``: how many rows ended for each reason."""

    batch_size: int
    new_tokens: int
    verification_steps: int
    tau: float
    seconds: float
    tokens_per_second: float
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.finish_reasons.items()))
        return (
            f"batch of {self.batch_size}: {self.new_tokens} tokens in {self.seconds:.2f} s, "
            f"{self.tokens_per_second:.1f} tokens/s, tau {self.tau:.2f} over "
            f"{self.verification_steps} batched verification forwards"
            + (f"; finish reasons: {reasons}" if reasons else "")
        )


def batch_stats(results: Sequence[GenerationResult], tallies: Sequence[_Tally]) -> BatchStats:
    """The batch's statistics from its rows' (time runs from the first row's start until the last
    row stopped: rows that waited for a place start later)."""
    steps = sum(t.verification_steps for t in tallies)
    now = time.perf_counter()
    seconds = max(t.finished or now for t in tallies) - min(t.started for t in tallies)
    new_tokens = sum(r.stats.new_tokens for r in results)
    return BatchStats(
        batch_size=len(results),
        new_tokens=new_tokens,
        verification_steps=max(t.verification_steps for t in tallies),
        tau=sum(t.emitted_by_steps for t in tallies) / steps if steps else float("nan"),
        seconds=seconds,
        tokens_per_second=new_tokens / seconds if seconds > 0 else float("inf"),
        finish_reasons=dict(Counter(r.finish_reason for r in results if r.finish_reason)),
    )


@dataclass(frozen=True)
class BatchGenerationResult:
    """A batch's ``results`` (one ``GenerationResult`` per prompt, in order) and its ``stats``."""

    results: list[GenerationResult]
    stats: BatchStats

    @property
    def texts(self) -> list[str | None]:
        return [r.text for r in self.results]

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each row's finish reason, in prompt order."""
        return [r.finish_reason for r in self.results]


class TextStream:
    """Iterate to get the answer's text as it is accepted (``(row, text)`` pairs for a batch);
    ``finish_reasons`` maps each row that has ended (0 for one prompt) to its finish reason as soon
    as it ends; ``result`` is set once the stream is exhausted."""

    def __init__(self, pieces: Iterator, finish_reasons: dict[int, str] | None = None):
        self._pieces = pieces
        self.result: GenerationResult | BatchGenerationResult | None = None
        self.finish_reasons = {} if finish_reasons is None else finish_reasons  # filled by ``pieces``

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces


# ---- the decode loop's state --------------------------------------------------------------------


@dataclass
class _Sequences:
    """Every prompt of a ``generate`` call and the tokens emitted after each: where each stops."""

    prompts: list[torch.Tensor]  # (T_b,) each
    max_new_tokens: int
    limits: list[int]  # final sequence lengths: prompt + max_new_tokens, within the context
    stop: StopRule
    tallies: list[_Tally]
    tokenizer: object | None
    emitted: list[list[int]]

    @classmethod
    def of(cls, prompts, max_new_tokens: int, context: int, stop: StopRule, tallies, tokenizer) -> _Sequences:
        limits = [min(context, p.numel() + max_new_tokens) for p in prompts]
        return cls(prompts, max_new_tokens, limits, stop, tallies, tokenizer, [[] for _ in prompts])

    def emit(self, row: int, tokens: list[int]) -> tuple[list[int], bool]:
        """Append ``tokens`` to row ``row``'s output up to where the sequence stops; returns the
        tokens kept and whether the row is done (its tally then holds the finish reason)."""
        prompt_length = self.prompts[row].numel()
        room = self.limits[row] - prompt_length - len(self.emitted[row])
        tokens, reason = self.stop.cut(self.emitted[row], tokens, room, self.tokenizer)
        self.emitted[row].extend(tokens)
        self.tallies[row].new_tokens += len(tokens)
        if reason == "length" and self.limits[row] < prompt_length + self.max_new_tokens:
            reason = "context"  # the room was the context's, not max_new_tokens'
        if reason is not None:
            self.tallies[row].finish(reason)
        return tokens, reason is not None


@dataclass
class _Batch:
    """The rows decoding now, as lists in batch order, and the KV cache they share."""

    rows: list[int] = field(default_factory=list)  # the caller's indices (into the prompts)
    lengths: list[int] = field(default_factory=list)  # entries per row: its next token's position
    roots: list[int] = field(default_factory=list)  # per row, the token its next tree starts from
    drafters: list[Drafter | None] = field(default_factory=list)  # None once the row is done
    cache: DynamicCache | None = None
    slots: torch.Tensor | None = None  # (B, L): which of the cache's slots hold each row's entries
    finished: list[int] = field(default_factory=list)  # rows done, leaving before the next step

    def drop_finished(self) -> None:
        """Finished rows leave the batch and its cache."""
        if not self.finished:
            return
        keep = [i for i, row in enumerate(self.rows) if row not in self.finished]
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self.roots = [self.roots[i] for i in keep]
        self.drafters = [self.drafters[i] for i in keep]
        if keep:
            self.slots = select_rows(self.cache, self.slots, keep)
        else:
            self.cache, self.slots = None, None
        self.finished = []


@dataclass(frozen=True)
class _StepPlan:
    """Whether a step drafts (else every row verifies its root alone: a plain step), whether the
    step gate decides that (and learns from the step), and the verify-cost curve weighed."""

    drafting: bool
    gated: bool
    cost: CostCurve | None = None


def _verify(
    drafts: Sequence[Draft],
    tokens_in_trees: Sequence[torch.Tensor],
    logits: torch.Tensor,
    drafting: bool,
    params: SamplingParams,
    generator: torch.Generator,
) -> list[Acceptance]:
    """Each row's accepted path and next token from the verification forward's ``logits`` (B, N, V)."""
    if not drafting and params.greedy:  # every row verifies its root alone: one argmax for all
        return [Acceptance((0,), token) for token in logits[:, 0].argmax(dim=-1).tolist()]
    return [
        verify_tree(logits[b, : tokens.numel()], tokens, draft.topology, params, generator)
        for b, (tokens, draft) in enumerate(zip(tokens_in_trees, drafts))
    ]


# ---- the generator ------------------------------------------------------------------------------


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids, as ``model.generate`` would stop on them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def default_pad_to_multiple(model) -> int:
    """4 for fp32 on CPU with the default kernels, where MKL's 2-3 row GEMMs cost as much as 4 rows;
    1 otherwise (GPU, bf16, or ``PackedLinear`` layers, whose cost grows smoothly from one row)."""
    if model.dtype == torch.float32 and model.device.type == "cpu" and not has_packed_linears(model):
        return 4
    return 1


def text_settings(context: bool | ContextTree | SuffixTree, suffix: bool) -> bool | ContextTree | SuffixTree:
    """``from_pretrained``'s ``context`` given ``suffix``: with it, suffix drafts where context
    drafts would be (``context=True``); a SuffixTree stands as it is."""
    if not suffix or isinstance(context, SuffixTree):
        return context
    if context is not True:
        raise ValueError(f"suffix=True drafts in place of context drafts: give context=True, not {context!r}")
    return SuffixTree()


class SpeculativeGenerator:
    """Decode with a draft head, context drafts or both on a base model, losslessly, one prompt or a
    batch of prompts of any lengths (each row drafts its own tree; one forward verifies them all).

    Args:
        base_model: the HF causal LM the head was trained on (sdpa or eager attention).
        head: a ``DraftHead`` of any kind, attached to ``base_model`` (and checked to fit); None
            drafts from the context alone (``draftheads.infer.context``).
        tokenizer: needed for chat messages, text output and streaming.
        tree: the head's tree: a registered tree name (``draftheads.infer.tree.TREES``), a
            ``StaticTree`` / ``DynamicTree``, or a Medusa-style choice list; default: the drafter's
            for this device. Trees deeper than the head can draft (Medusa K heads, MTP D modules)
            are cut to fit. Without a head, a ``ContextTree`` (default ``ContextTree()``) or a
            ``SuffixTree``.
        pad_to_multiple: pad each tree to a multiple of this many tokens (padding is masked and never
            accepted); default ``default_pad_to_multiple(base_model)``.
        context: also draft continuations from the context and merge them into the head's tree
            (``draftheads.infer.hybrid``): True for the default ``ContextTree()``, a ContextTree, or a
            ``SuffixTree`` for suffix drafts (``draftheads.infer.suffix``), which also match the
            answers of the generator's earlier sequences (``history``); without a head, a
            SuffixTree here drafts alone as ``tree`` would.
        adaptive: prune every step's tree to the nodes whose calibrated acceptance pays for their
            verification, let a head that does not pay sit steps out (``draftheads.infer.adaptive``),
            and step plainly while drafting emits fewer tokens per second than plain steps would
            (``draftheads.infer.step_gate``).
        cost: the verify-cost curve adaptive drafting weighs against (``draftheads.infer.verify_cost``);
            default: measured on this machine at the first ``generate`` call.
        confidence: with ``adaptive``, a learned acceptance head that prices every node in place of
            the online calibration (``draftheads.infer.confidence``, ``draftheads fit-confidence``).
    """

    def __init__(
        self,
        base_model,
        head=None,
        tokenizer=None,
        tree=None,
        pad_to_multiple: int | None = None,
        context: bool | ContextTree | SuffixTree = False,
        adaptive: bool = False,
        cost: CostCurve | None = None,
        confidence=None,
    ):
        implementation = getattr(base_model.config, "_attn_implementation", None)
        if implementation not in SUPPORTED_ATTENTION:
            raise TreeInputError(
                f"base model uses attn_implementation '{implementation}'; tree verification needs one of "
                f"{SUPPORTED_ATTENTION} (load it with "
                "draftheads.base_model.load_base(..., attn_implementation='sdpa'))"
            )
        self.model = base_model
        self.head = head.attach(base_model).eval() if head is not None else None
        self.tokenizer = tokenizer
        if pad_to_multiple is None:
            pad_to_multiple = default_pad_to_multiple(base_model)
        self.pad_to_multiple = pad_to_multiple
        self.context = ContextTree() if context is True else (context or None)
        if head is None:
            if tree is not None and not isinstance(tree, (ContextTree, SuffixTree)):
                raise ValueError(f"without a head the tree is a ContextTree or a SuffixTree, got {tree!r}")
            self.tree = tree or (self.context if isinstance(self.context, SuffixTree) else ContextTree())
            self.context = None
        else:
            head_drafter = drafter_for(self.head, pad_to_multiple)
            device_type = "cuda" if base_model.device.type == "cuda" else "cpu"
            chosen = resolve_tree(tree if tree is not None else head_drafter.default_trees[device_type])
            head_drafter.check_tree(chosen)
            check_tree_fits(chosen, draft_vocabulary_size(self.head), base_model.device)
            chosen = chosen.truncated(head_drafter.max_depth)  # -1 (EAGLE): no limit
            self.tree = chosen if self.context is None else HybridTree(chosen, self.context)
        # suffix drafting's earlier answers: each finished sequence's, kept from one call to the next
        suffix = isinstance(self.tree if head is None else self.context, SuffixTree)
        self.history = SuffixHistory() if suffix else None
        self.eos_ids = _eos_ids(base_model, tokenizer)
        self.kernels = packed_description(base_model)  # from_pretrained adds how it was chosen
        self.max_length = getattr(base_model.config, "max_position_embeddings", None)
        self.adaptive = adaptive
        self.cost = cost
        self.batch_costs: dict[int, CostCurve] = {}  # verify-cost curves by batch size, measured on need
        self.calibration = Calibration()  # adaptive drafting's, carried from one sequence to the next
        self.step_gate = StepGate()  # adaptive: whether steps draft at all, per batch size; carried too
        # adaptive: whether the head drafts; each sequence starts from the last finished one's
        self.head_gate: HeadGate | None = None
        if confidence is not None and not adaptive:
            raise ValueError(NEEDS_ADAPTIVE)
        self.confidence = confidence  # adaptive: a learned acceptance head in place of the calibration
        # called after every verified step with the row's draft and its accepted nodes (traces)
        self.step_observers: list[Callable[[Draft, tuple[int, ...]], None]] = []

    @property
    def method(self) -> str:
        """What drafts: the head's kind, "context" or "suffix", or "<kind>+context" / "<kind>+suffix";
        "/adaptive" when adaptive."""
        text = self._text_drafter()
        name = text.source if self.head is None else self.head.kind
        if self.head is not None and text is not None:
            name += "+" + text.source
        return name + ("/adaptive" if self.adaptive else "") + ("/confidence" if self.confidence else "")

    def _text_drafter(self) -> ContextDrafter | SuffixDrafter | None:
        """The drafter of the text for one sequence, as the settings say; None for a head alone."""
        settings = self.tree if self.head is None else self.context
        if isinstance(settings, SuffixTree):
            return SuffixDrafter(self.history, self.pad_to_multiple)
        return ContextDrafter(self.pad_to_multiple) if settings is not None else None

    def new_drafter(self) -> Drafter:
        """A drafter for one sequence (``draftheads.infer.draft``): the head's (by its drafting
        style), the text's (context or suffix drafts), or both merged; wrapped by adaptive drafting
        if asked."""
        text = self._text_drafter()
        if self.head is None:
            drafter = text
        else:
            drafter = drafter_for(self.head, self.pad_to_multiple)
            if text is not None:
                drafter = HybridDrafter(drafter, text)
        if self.adaptive:
            gate = copy.copy(self.head_gate) if self.head_gate is not None else None
            drafter = AdaptiveDrafter(drafter, self.cost, self.calibration, gate, self.confidence)
        return drafter

    @classmethod
    def from_pretrained(
        cls,
        head_dir: str | Path | None,
        base: str | None = None,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        device: str = DEFAULT_DEVICE,
        tree=None,
        pack: bool | str = DEFAULT_PACK,
        context: bool | ContextTree | SuffixTree = RECOMMENDED_CONTEXT,
        suffix: bool = RECOMMENDED_SUFFIX,
        adaptive: bool = RECOMMENDED_ADAPTIVE,
        draft_dtype: str = DEFAULT_DRAFT_DTYPE,
        confidence: bool = False,
    ) -> SpeculativeGenerator:
        """Load a saved head and its base model (by default the one recorded in the head's
        config.json ``base_model.name_or_path``); ``head_dir=None`` (with ``base``): no head, the
        context drafter alone. Without ``tree``, the head's tuned tree for this
        device and dtype (``draftheads tune-tree``) is used if there is one, else the default.
        ``pack``: ``auto`` runs the base model's linear layers through prepacked oneDNN weights for
        the forwards (one-token, multi-token) where that measured faster on this machine (measured
        at the first load, then cached: ``draftheads.infer.kernel_choice``); True packs for all
        where that applies (fp32 on an x86 CPU), False never; the head is packed when the base is
        for any form. The choice is in ``generator.kernels`` and every result's stats. ``context``:
        merge context drafts into the head's trees; ``suffix``: suffix drafts in their place, alone or
        merged (``draftheads.infer.suffix``; see ``text_settings``); ``adaptive``: adaptive drafting,
        weighing against the verify-cost curves ``tune-tree`` measured on this machine (saved in
        the head's ``tree.json``), else curves measured at the first call (see the class).
        ``draft_dtype``: the dtype the head drafts in, ``auto`` (bf16 where that pays, see
        ``draftheads.infer.precision``), ``float32`` or ``bfloat16``; the output does not depend on it.
        ``confidence``: with ``adaptive``, price nodes with the acceptance head ``draftheads
        fit-confidence`` saved in the head directory (``draftheads.infer.confidence``)."""
        from draftheads.base_model import load_base
        from draftheads.device import check_device
        from draftheads.heads import load_head_and_base, resolve_base_model
        from draftheads.heads.base import HeadFormatError, resolve_head_dir

        # Before loading: a model moved to an unusable device fails deep in torch. ``auto`` resolved.
        device = str(check_device(device))
        context = text_settings(context, suffix)  # refused before anything loads
        if confidence and not adaptive:
            raise ValueError(NEEDS_ADAPTIVE)
        if head_dir is None:
            if confidence:
                raise ValueError("a confidence head is fitted for a head: give its directory")
            if not base:
                raise ValueError("without a head directory, give the base model (base=...)")
            model, tokenizer = load_base(base, dtype=dtype, device=device)
            kernels = choose_kernels(model, pack)
            alone = SuffixTree() if suffix and tree is None else tree
            generator = cls(model, None, tokenizer, tree=alone, adaptive=adaptive)
            generator.kernels = kernels.describe()
            return generator
        head_dir = resolve_head_dir(head_dir)  # a training run's output directory: its head/
        acceptance = load_confidence(head_dir) if confidence else None  # a broken file: before the base loads
        model, tokenizer = load_base(resolve_base_model(head_dir, base), dtype=dtype, device=device)
        # A Medusa-2 head drafts for its adapted base: adapt the base loaded here in place.
        head, model = load_head_and_base(head_dir, model, map_location=device, copy_base=False)
        kernels = choose_kernels(model, pack)
        prepare_drafting_head(head, model, kernels, draft_dtype)
        tuned = tree is None
        if tuned:  # the tree `draftheads tune-tree` chose for this device and dtype, if any
            tree = load_tuned_tree(head_dir, model.dtype, model.device)
        costs = load_tuned_costs(head_dir, model.dtype, model.device)  # measured here by tune-tree
        try:
            generator = cls(
                model,
                head,
                tokenizer,
                tree=tree,
                context=context,
                adaptive=adaptive,
                cost=costs.get(1),
                confidence=acceptance,
            )
        except TreeFitError as err:  # a tree.json this head cannot draft: a fault of the head's files
            if not tuned or tree is None:
                raise
            key = tuned_tree_key(model.dtype, model.device)
            raise HeadFormatError(f"{Path(head_dir) / TUNED_TREE_FILE}: trees.{key}.tree: {err}") from err
        generator.batch_costs.update(costs)
        generator.kernels = kernels.describe()
        return generator

    # ---- inputs -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt, where: str, template: str | None) -> torch.Tensor:
        """(T,) prompt ids from ids (a list of ints, a (T,) or (1, T) integer tensor), text, or chat
        messages (rendered by ``template``: chat | plain); refuses what the model cannot read, naming it."""
        if isinstance(prompt, str) or _is_messages(prompt):
            if self.tokenizer is None:
                raise PromptError(
                    "text or chat-message prompts need a tokenizer: SpeculativeGenerator(..., tokenizer=)"
                )
            if isinstance(prompt, str):
                prompt = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            else:
                prompt = messages_prompt_ids(self.tokenizer, prompt, where, template)
        if isinstance(prompt, torch.Tensor):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise PromptError(f"{where}: token ids must be integers, got a {prompt.dtype} tensor")
            ids = prompt.to(torch.long)
        else:
            values = list(prompt) if isinstance(prompt, (list, tuple)) else None
            if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                bad = next(
                    (v for v in values or [prompt] if not isinstance(v, int) or isinstance(v, bool)), prompt
                )
                raise PromptError(
                    f"{where}: expected token ids (ints), text or chat messages; got {type(bad).__name__} "
                    f"{str(bad)[:40]!r}"
                )
            ids = torch.tensor(values, dtype=torch.long)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise PromptError(f"{where}: expected one sequence of token ids, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise PromptError(f"{where}: the prompt is empty")
        vocab = self.model.get_input_embeddings().num_embeddings
        outside = ids[(ids < 0) | (ids >= vocab)]
        if outside.numel():
            raise PromptError(
                f"{where}: token id {int(outside[0])} is outside the vocabulary (0..{vocab - 1})"
            )
        if self.max_length is not None and ids.numel() >= self.max_length:
            raise PromptError(
                f"{where}: the prompt has {ids.numel()} tokens; the model's context is {self.max_length}"
            )
        return ids.to(self.model.device)

    def _prompts(self, prompt, template: str) -> tuple[list[torch.Tensor], bool, tuple[str, ...]]:
        """The prompts as (T_b,) ids, whether a batch was given (a list of prompts: texts, chats, id
        lists or tensors; or a (B, T) tensor with B > 1; anything else is one prompt), and the stop
        strings the rendering of their chat messages implies (``prompt_format.stop_strings``)."""
        batched = (isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[0] > 1) or (
            isinstance(prompt, (list, tuple))
            and prompt
            and isinstance(prompt[0], (str, list, tuple, torch.Tensor))
        )
        prompts = list(prompt) if batched else [prompt]
        chosen = None  # chat | plain, where chat messages are given
        if self.tokenizer is not None and any(_is_messages(p) for p in prompts):
            chosen = choose_template(template, self.tokenizer, "template")
        wheres = [f"prompt {b}" for b in range(len(prompts))] if batched else ["prompt"]
        ids = [self._prompt_ids(p, where, chosen) for p, where in zip(prompts, wheres)]
        return ids, batched, stop_strings(chosen) if chosen else ()

    # ---- the decode loop ----------------------------------------------------------------------

    def _batch_cost(self, batch: int, cache, roots: Sequence[int], slots: torch.Tensor) -> CostCurve:
        """The verify-cost curve for ``batch`` rows: the constructor's ``cost`` for one row, else the
        one in ``batch_costs`` (from ``tune-tree``, or measured before) for the smallest batch from
        this size to twice it, else measured now with the live cache (which is left as it was)."""
        if self.cost is not None and batch == 1:
            return self.cost
        # A curve for a somewhat larger batch bounds this one's costs from above (a batch that lost
        # a row or two keeps its curve); a much larger one would price trees far too high.
        larger = [b for b in self.batch_costs if batch <= b <= 2 * batch]
        if larger:
            return self.batch_costs[min(larger)]
        largest = padded_size(self.tree.max_nodes, self.pad_to_multiple)
        sizes = [n for n in COST_SIZES if n < largest] + [largest]
        self.batch_costs[batch] = measure_verify_cost(
            self.model, cache, roots[0], sizes, repeats=3, slots=slots
        )
        if batch == 1:
            self.cost = self.batch_costs[1]
        return self.batch_costs[batch]

    @torch.inference_mode()
    def _decode(
        self,
        prompts: list[torch.Tensor],
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
        tallies: list[_Tally],
        stop: StopRule,
        batch_size: int | None = None,
    ) -> Iterator[list[tuple[int, list[int]]]]:
        """Decode a batch of prompts (each (T_b,)); yield each step's new tokens as (row, tokens)
        pairs: after each prefill, then after every verification forward. ``row`` is the prompt's
        index in ``prompts``.

        The batch's cache rows hold each sequence in order (prompt, then accepted tokens); the
        slots a row does not occupy are masked (``rows_forward``). Each row drafts its own tree;
        one forward verifies every row's; each row keeps its own accepted path
        (``keep_accepted_rows``), so rows advance by different amounts; a row that is done leaves
        the batch and costs nothing more. One row is the plain single-sequence case.

        ``batch_size``: at most this many rows decode at once; the other prompts wait, and each
        row that finishes is replaced by the next waiting prompt (prefilled on its own and added
        to the batch's cache, ``add_rows``), so rows that accept more never wait for the slowest
        (continuous batching). None: every prompt at once.
        """
        hidden_layers = () if self.head is None else tuple(self.head.feature_layers)
        context = self.max_length or 2**62
        width = len(prompts) if batch_size is None else batch_size  # rows decoding at once, at most
        waiting = list(range(len(prompts)))  # the prompts not started yet, in order
        sequences = _Sequences.of(prompts, max_new_tokens, context, stop, tallies, self.tokenizer)
        batch = _Batch()
        # Whether the head has tokens to catch up on beyond the last step's (a prompt, then the
        # tokens of plain steps): a drafting step that does so is not what steady drafting costs.
        head_behind = self.head is not None
        while True:
            batch.drop_finished()
            if waiting and len(batch.rows) < width:  # start waiting prompts in the free rows
                started = waiting[: width - len(batch.rows)]
                del waiting[: len(started)]
                chunks = self._start_rows(batch, started, sequences, params, generator, hidden_layers)
                head_behind = self.head is not None
                yield chunks
                continue
            if not batch.rows:
                return
            plan = self._plan_step(batch, tallies)
            step_started = time.perf_counter()
            drafts, expected = self._draft(batch, plan, context)
            tokens_in_trees = [draft.padded_tokens for draft in drafts]  # (N_b,) each
            output = rows_forward(
                self.model,
                batch.cache,
                tokens_in_trees,
                [d.topology for d in drafts],
                batch.slots,
                hidden_layers,
            )
            acceptances = _verify(drafts, tokens_in_trees, output.logits, plan.drafting, params, generator)
            chunks, step_tokens = self._accept(
                batch, drafts, tokens_in_trees, acceptances, output.hidden_states, sequences
            )
            if self.adaptive and plan.gated:
                self._record_step(
                    len(batch.rows),
                    plan.drafting,
                    step_started,
                    step_tokens,
                    expected,
                    bool(waiting),
                    head_behind,
                )
            head_behind = self.head is not None and not plan.drafting
            yield chunks

    def _start_rows(
        self,
        batch: _Batch,
        started: list[int],
        sequences: _Sequences,
        params: SamplingParams,
        generator: torch.Generator,
        hidden_layers: tuple[int, ...],
    ) -> list[tuple[int, list[int]]]:
        """Prefill the prompts ``started`` (their indices) in one forward, add them to the batch and
        its cache, and emit each one's first token; returns the (row, tokens) chunks. A row done at
        once (EOS, or no room) has no drafter and joins ``batch.finished``."""
        prompts = sequences.prompts
        for row in started:  # a row's time runs from its prefill
            sequences.tallies[row].started = time.perf_counter()
        new_cache, logits, hidden_states = prefill_rows(
            self.model, [prompts[r] for r in started], hidden_layers
        )
        new_lengths = [prompts[r].numel() for r in started]
        new_slots = left_aligned_slots(new_lengths, new_cache.get_seq_length())
        if batch.cache is None:
            batch.cache, batch.slots = new_cache, new_slots
        else:
            batch.slots = add_rows(batch.cache, batch.slots, new_cache, new_slots)
        chunks = []
        for i, row in enumerate(started):
            root = next_token(logits[i], params, generator)
            tokens, done = sequences.emit(row, [root])
            chunks.append((row, tokens))
            batch.rows.append(row)
            batch.lengths.append(new_lengths[i])
            batch.roots.append(root)
            if done:
                batch.finished.append(row)
                batch.drafters.append(None)
                continue
            drafter = self.new_drafter()
            drafter.start(_row_states(hidden_states, i, new_lengths[i]), prompts[row][None], root)
            batch.drafters.append(drafter)
        return chunks

    def _plan_step(self, batch: _Batch, tallies: list[_Tally]) -> _StepPlan:
        """Whether the next step drafts: always without adaptive drafting; with it, never where the
        batch is compute-bound, else as the step gate decides (``draftheads.infer.step_gate``)."""
        if not self.adaptive:
            return _StepPlan(drafting=True, gated=True)
        measuring = time.perf_counter()
        cost = self._batch_cost(len(batch.rows), batch.cache, batch.roots, batch.slots)
        for tally in tallies:  # a one-time measurement, not decoding
            tally.started += time.perf_counter() - measuring
        for drafter in batch.drafters:
            drafter.cost = cost
        # Where even a tree whose every node is accepted would not pay (the batch is
        # compute-bound), the rows do not draft at all: plain batched decoding steps. Else
        # the step gate keeps whichever kind of step has emitted more tokens per second.
        gated = cost.ceiling()[0] > 1.0
        return _StepPlan(drafting=gated and self.step_gate.drafts(len(batch.rows)), gated=gated, cost=cost)

    def _draft(self, batch: _Batch, plan: _StepPlan, context: int) -> tuple[list[Draft], list[float] | None]:
        """Each row's tree for this step: its drafter's proposal, or its root alone where the step
        does not draft; under adaptive drafting, a batch's trees pruned to one size. With them,
        under adaptive drafting, the tokens each row's tree is expected to emit (for the step
        gate), from the prices its drafter pruned by; else None."""
        # Node depth d lands at position length + d; accepting d drafts makes the sequence
        # length + d + 2 long, which must stay within the context: at its edge, verify the root alone.
        trees = [
            self.tree.truncated(context - n - 2) if plan.drafting and context - n - 2 > 0 else None
            for n in batch.lengths
        ]
        drafts = propose_rows(batch.drafters, batch.roots, batch.lengths, trees)
        if not (self.adaptive and plan.drafting):
            return drafts, None
        probabilities = [d.path_probabilities(x) for d, x in zip(batch.drafters, drafts)]
        if len(batch.rows) == 1:
            return drafts, [sum(probabilities[0])]
        # one tree size: see common_tree_size
        size = common_tree_size([p[1:] for p in probabilities], plan.cost.relative, self.pad_to_multiple)
        kept = [likeliest_nodes(p, size) for p in probabilities]
        drafts = [prune_draft(x, nodes, self.pad_to_multiple) for x, nodes in zip(drafts, kept)]
        return drafts, [sum(p[n] for n in nodes) for p, nodes in zip(probabilities, kept)]

    def _accept(
        self,
        batch: _Batch,
        drafts: list[Draft],
        tokens_in_trees: list[torch.Tensor],
        acceptances: list[Acceptance],
        hidden_states,
        sequences: _Sequences,
    ) -> tuple[list[tuple[int, list[int]]], int]:
        """Keep each row's accepted path in the cache, emit its tokens, and let its drafter learn
        from the step and take in the accepted tokens' features (``hidden_states``: the forward's).
        Returns the (row, tokens) chunks and the tokens the step emitted before any stop cut them."""
        accepted = [torch.tensor(a.nodes, dtype=torch.long) for a in acceptances]  # (A_b,) each
        batch.slots = keep_accepted_rows(batch.cache, batch.slots, accepted)
        new_lengths = [length + path.numel() for length, path in zip(batch.lengths, accepted)]
        chunks, step_tokens = [], 0
        for b, row in enumerate(batch.rows):
            acceptance, draft, drafter = acceptances[b], drafts[b], batch.drafters[b]
            step_tokens += acceptance.accepted_drafts + 1
            sequences.tallies[row].record_step(acceptance.accepted_drafts)
            sequences.tallies[row].record_sources(draft.sources, acceptance.nodes)
            drafter.record(draft, acceptance.nodes)
            for observe in self.step_observers:
                observe(draft, acceptance.nodes)
            new = tokens_in_trees[b][accepted[b][1:]].tolist() + [acceptance.next_token]
            tokens, done = sequences.emit(row, new)
            chunks.append((row, tokens))
            if done:
                batch.finished.append(row)
                if self.history is not None:  # suffix drafting matches it in later sequences
                    self.history.add(sequences.emitted[row])
                if self.adaptive and drafter.gate is not None:  # what it learned, for the next
                    self.head_gate = drafter.gate
                continue
            index = accepted[b].to(self.model.device)
            features = drafter.select_features(_row_states(hidden_states, b), index)  # (1, A, F)
            ids = torch.tensor([new], device=sequences.prompts[row].device)  # (1, A)
            drafter.commit(features, ids, batch.lengths[b])
            batch.roots[b] = acceptance.next_token
        batch.lengths = new_lengths
        return chunks, step_tokens

    def _record_step(
        self,
        rows: int,
        drafted: bool,
        step_started: float,
        step_tokens: int,
        expected: list[float] | None,
        prompts_waiting: bool,
        head_behind: bool,
    ) -> None:
        """Tell the step gate how the step of ``rows`` rows went, from ``step_started`` until now.

        The gate weighs a drafting step by the tokens it was expected to emit (``expected``, per
        row: calibrated path probabilities): one step's 1, 2 or 3 accepted tokens are too noisy to
        compare. A batch is done when its slowest row is: rows that draft drift apart, and the rows
        left behind then decode in small, inefficient batches. So the step advances the batch by
        its least-advanced row's tokens, in every row; while prompts wait, a row that finishes is
        replaced at once, rows need not keep pace, and the batch advances by all its rows' tokens.
        """
        seconds = time.perf_counter() - step_started
        if not drafted:
            self.step_gate.record(rows, False, step_tokens, seconds)
            return
        advance = sum(expected) if prompts_waiting else rows * min(expected)
        self.step_gate.record(
            rows, True, advance, seconds, emitted=step_tokens, expected=sum(expected), catching_up=head_behind
        )

    # ---- public API ---------------------------------------------------------------------------

    def generate(
        self,
        prompt,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stream: bool = False,
        seed: int | None = None,
        acceptance: str = "exact",
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] = (),
        batch_size: int | None = None,
        template: str = DEFAULT_TEMPLATE,
    ) -> GenerationResult | BatchGenerationResult | TextStream:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (or after each of a batch).

        Args:
            prompt: one prompt: token ids (a list of ints, a (T,) or (1, T) tensor), a string, or
                chat messages (``[{"role": "user", "content": ...}]``, rendered by ``template``);
                or a batch: a list of prompts (of any lengths) or a (B, T) tensor. A batch decodes
                in one verification forward per step for all rows.
            temperature: 0 is greedy (output identical to ``model.generate(do_sample=False)`` in fp32,
                row by row); above 0, the output follows the base model's sampling distribution
                after top_p/top_k.
            stream: return a ``TextStream`` yielding text as it is accepted (needs a tokenizer);
                for a batch it yields ``(row, text)`` pairs.
            seed: seeds the sampling generator (reproducible sampling).
            acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance, lossy).
            stop: a string or strings that end a sequence (the token completing one is kept in the
                tokens; the text ends before it); needs a tokenizer.
            stop_token_ids: token ids that end a sequence besides EOS (kept, as EOS is).
            batch_size: for a batch, decode at most this many prompts at once: as a row finishes,
                the next prompt takes its place (continuous batching), so no row waits for a
                slower one. None: every prompt of the batch at once.
            template: how chat messages become the prompt (``draftheads.prompt_format``): ``chat``
                (the tokenizer's chat template), ``plain`` ('User: ...' / 'Assistant: ...' text,
                for a base without a template; the answer also stops where the model begins the
                next 'User:' turn) or ``auto`` (chat where the tokenizer has a template, else plain).
        Returns:
            A ``GenerationResult`` (sequences, text, ``GenerationStats``) for one prompt, a
            ``BatchGenerationResult`` for a batch, or a ``TextStream`` whose ``result`` holds it
            once exhausted. A sequence stops after EOS or a stop token (included), a stop string,
            ``max_new_tokens``, or at the model's context length.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, acceptance=acceptance)
        strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: SpeculativeGenerator(..., tokenizer=)")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {list(stop_token_ids)!r}")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
        check_template(template, "template")
        prompts, batched, implied = self._prompts(prompt, template)
        strings += tuple(s for s in implied if s not in strings)
        rule = StopRule(self.eos_ids | frozenset(stop_token_ids), strings, self.eos_ids)
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        if stream:
            if self.tokenizer is None:
                raise ValueError("stream=True needs a tokenizer to decode text")
            reasons: dict[int, str] = {}
            return TextStream(
                self._stream(prompts, batched, max_new_tokens, params, generator, rule, batch_size, reasons),
                reasons,
            )
        tallies = [_Tally() for _ in prompts]
        new_tokens: list[list[int]] = [[] for _ in prompts]
        for chunks in self._decode(prompts, max_new_tokens, params, generator, tallies, rule, batch_size):
            for row, tokens in chunks:
                new_tokens[row].extend(tokens)
        return self._result(prompts, batched, new_tokens, tallies, rule)

    def _result(self, prompts, batched: bool, new_tokens, tallies, rule: StopRule):
        results = []
        for ids, tokens, tally in zip(prompts, new_tokens, tallies):
            sequences = torch.cat([ids.cpu(), torch.tensor(tokens, dtype=torch.long)])[None]
            text = None
            if self.tokenizer is not None:
                text = rule.trim_text(self.tokenizer.decode(tokens, skip_special_tokens=True))
            stats = tally.stats(self.tree.name, self.kernels)
            results.append(GenerationResult(sequences, ids.numel(), stats, text))
        if not batched:
            return results[0]
        return BatchGenerationResult(results, batch_stats(results, tallies))

    def _stream(self, prompts, batched, max_new_tokens, params, generator, rule, batch_size, reasons):
        """Text pieces as steps are accepted ((row, piece) for a batch); returns the result at the end.
        Each row's finish reason goes into ``reasons`` as the row ends."""
        tallies = [_Tally() for _ in prompts]
        new_tokens: list[list[int]] = [[] for _ in prompts]
        printed = [""] * len(prompts)
        for chunks in self._decode(prompts, max_new_tokens, params, generator, tallies, rule, batch_size):
            for row, tokens in chunks:
                new_tokens[row].extend(tokens)
                if tallies[row].finish_reason is not None:
                    reasons[row] = tallies[row].finish_reason
                text = rule.trim_text(self.tokenizer.decode(new_tokens[row], skip_special_tokens=True))
                if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next byte
                    continue
                if len(text) > len(printed[row]):
                    piece = text[len(printed[row]) :]
                    yield (row, piece) if batched else piece
                printed[row] = text
        return self._result(prompts, batched, new_tokens, tallies, rule)


def _is_messages(prompt) -> bool:
    """Whether a prompt is chat messages (a list of dicts) rather than ids or text."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def _row_states(hidden_states, row: int, length: int | None = None):
    """Row ``row`` of a forward's selected ``hidden_states`` (entries (B, T, h), None where not
    asked for) as a batch of one, its first ``length`` positions."""
    if hidden_states is None:  # a drafter that reads no features
        return None
    return tuple(None if h is None else h[row : row + 1, :length] for h in hidden_states)
