"""Lossless speculative decoding: the decode loop and its public API.

Read top to bottom: the statistics, the decode loop (``SpeculativeGenerator._decode``, the only loop
over decoding steps in the package), and the public ``SpeculativeGenerator`` with ``generate`` and
``from_pretrained``.

One step: a Drafter proposes a tree (``draft.py``: a head's, the context's, or both merged); the
unmodified Hugging Face model verifies every node in ONE forward through a 4D additive mask with
explicit positions (``forward.py``, ``tree.py``); a
verifier (``verify.py``) keeps the longest valid path plus the base model's own next token; the KV
cache keeps only the accepted entries (``cache.py``). Greedy decoding in fp32 reproduces
``model.generate(do_sample=False)`` token for token; sampling follows the base model's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftheads.base_model import DEFAULT_DTYPE
from draftheads.infer.adaptive import AdaptiveDrafter, Calibration
from draftheads.infer.cache import keep_accepted
from draftheads.infer.context import ContextDrafter, ContextTree
from draftheads.infer.cost import CostCurve, measure_verify_cost
from draftheads.infer.draft import Drafter, drafter_for, root_only
from draftheads.infer.forward import SUPPORTED_ATTENTION, TreeInputError, prefill_forward, tree_forward
from draftheads.infer.hybrid import HybridDrafter, HybridTree
from draftheads.infer.packed import has_packed_linears, pack_linears
from draftheads.infer.tree import load_tuned_tree, padded_size, resolve_tree
from draftheads.infer.verify import SamplingParams, next_token, verify_tree

DEFAULT_MAX_NEW_TOKENS = 256
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # tree sizes adaptive drafting measures
# What ``from_pretrained`` and ``draftheads generate`` draft with unless told otherwise: the best
# measured (docs/benchmarks.md: a head's tree with context drafts merged in, adaptive; an untrained
# head then costs least). The constructor drafts exactly as it is told: the head alone by default.
RECOMMENDED_CONTEXT = True
RECOMMENDED_ADAPTIVE = True


# ---- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationStats:
    """What one ``generate`` call did.

    tau, the mean accepted length, counts the token the base model produces itself at each
    verification step: a step that accepts d draft tokens emits d + 1 tokens, so tau = 1 without a
    head and tau <= depth + 1 (EAGLE counts this way, Li et al. 2024; some engines do not).
    tau is measured over verification forwards (the prefill forward is not one) before truncation
    at EOS or max_new_tokens; it is NaN when no verification step ran.
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
        )


@dataclass
class _Tally:
    """Counters the decode loop fills in (one per ``generate`` call)."""

    started: float = field(default_factory=time.perf_counter)
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

    def stats(self, tree_name: str) -> GenerationStats:
        seconds = time.perf_counter() - self.started
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


class TextStream:
    """Iterate to get the answer's text as it is accepted; ``result`` is set once it is exhausted."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        self.result = yield from self._pieces


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


class SpeculativeGenerator:
    """Decode with a draft head, context drafts or both on a base model, losslessly, one sequence at
    a time.

    Args:
        base_model: the HF causal LM the head was trained on (sdpa or eager attention).
        head: a ``DraftHead`` of any kind, attached to ``base_model`` (and checked to fit); None
            drafts from the context alone (``draftheads.infer.context``).
        tokenizer: needed for chat messages, text output and streaming.
        tree: the head's tree: a registered tree name (``draftheads.infer.tree.TREES``), a
            ``StaticTree`` / ``DynamicTree``, or a Medusa-style choice list; default: the drafter's
            for this device. Trees deeper than the head can draft (Medusa K heads, MTP D modules)
            are cut to fit. Without a head, a ``ContextTree`` (default ``ContextTree()``).
        pad_to_multiple: pad each tree to a multiple of this many tokens (padding is masked and never
            accepted); default ``default_pad_to_multiple(base_model)``.
        context: also draft continuations from the context and merge them into the head's tree
            (``draftheads.infer.hybrid``): True for the default ``ContextTree()``, or a ContextTree.
        adaptive: prune every step's tree to the nodes whose calibrated acceptance pays for their
            verification, and let a head that does not pay sit steps out (``draftheads.infer.adaptive``).
        cost: the verify-cost curve adaptive drafting weighs against (``draftheads.infer.cost``);
            default: measured on this machine at the first ``generate`` call.
    """

    def __init__(
        self,
        base_model,
        head=None,
        tokenizer=None,
        tree=None,
        pad_to_multiple: int | None = None,
        context: bool | ContextTree = False,
        adaptive: bool = False,
        cost: CostCurve | None = None,
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
            if tree is not None and not isinstance(tree, ContextTree):
                raise ValueError(f"without a head the tree is a ContextTree, got {tree!r}")
            self.context = None
            self.tree = tree or ContextTree()
        else:
            head_drafter = drafter_for(self.head, pad_to_multiple)
            device_type = "cuda" if base_model.device.type == "cuda" else "cpu"
            chosen = resolve_tree(tree if tree is not None else head_drafter.default_trees[device_type])
            head_drafter.check_tree(chosen)
            chosen = chosen.truncated(head_drafter.max_depth)  # -1 (EAGLE): no limit
            self.tree = chosen if self.context is None else HybridTree(chosen, self.context)
        self.eos_ids = _eos_ids(base_model, tokenizer)
        self.max_length = getattr(base_model.config, "max_position_embeddings", None)
        self.adaptive = adaptive
        self.cost = cost
        self.calibration = Calibration()  # adaptive drafting's, carried from one sequence to the next

    @property
    def method(self) -> str:
        """What drafts: the head's kind, "context", or "<kind>+context"; "/adaptive" when adaptive."""
        name = "context" if self.head is None else self.head.kind
        if self.head is not None and self.context is not None:
            name += "+context"
        return name + ("/adaptive" if self.adaptive else "")

    def new_drafter(self) -> Drafter:
        """A drafter for one sequence (``draftheads.infer.draft``): the head's (by its drafting
        style), the context drafter, or both merged; wrapped by adaptive drafting if asked."""
        if self.head is None:
            drafter = ContextDrafter(self.pad_to_multiple)
        else:
            drafter = drafter_for(self.head, self.pad_to_multiple)
            if self.context is not None:
                drafter = HybridDrafter(drafter)
        if self.adaptive:
            drafter = AdaptiveDrafter(drafter, self.cost, self.calibration)
        return drafter

    def _measure_cost(self, cache, root: int) -> None:
        """The verify-cost curve, once, after the first prompt's prefill (the cache is left as it was)."""
        largest = padded_size(self.tree.max_nodes, self.pad_to_multiple)
        sizes = [n for n in COST_SIZES if n < largest] + [largest]
        self.cost = measure_verify_cost(self.model, cache, root, sizes, repeats=3)

    @classmethod
    def from_pretrained(
        cls,
        head_dir: str | Path | None,
        base: str | None = None,
        dtype: str | torch.dtype = DEFAULT_DTYPE,
        device: str = "cpu",
        tree=None,
        pack: bool = True,
        context: bool | ContextTree = RECOMMENDED_CONTEXT,
        adaptive: bool = RECOMMENDED_ADAPTIVE,
    ) -> SpeculativeGenerator:
        """Load a saved head and its base model (by default the one recorded in the head's
        config.json ``base_model.name_or_path``); ``head_dir=None`` (with ``base``): no head, the
        context drafter alone. Without ``tree``, the head's tuned tree for this
        device and dtype (``draftheads tune-tree``) is used if there is one, else the default.
        ``pack``: run the base model's and the head's linear layers through prepacked oneDNN
        weights where that applies (fp32 on an x86 CPU; ``draftheads.infer.packed``). ``context``:
        merge context drafts into the head's trees; ``adaptive``: adaptive drafting,
        weighing against a verify-cost curve measured at the first call (see the class)."""
        from draftheads.base_model import load_base
        from draftheads.heads import load_head_and_base, resolve_base_model

        if head_dir is None:
            if not base:
                raise ValueError("without a head directory, give the base model (base=...)")
            model, tokenizer = load_base(base, dtype=dtype, device=device)
            if pack:
                pack_linears(model)
            return cls(model, None, tokenizer, tree=tree, adaptive=adaptive)
        model, tokenizer = load_base(resolve_base_model(head_dir, base), dtype=dtype, device=device)
        # A Medusa-2 head drafts for its adapted base: adapt the base loaded here in place.
        head, model = load_head_and_base(head_dir, model, map_location=device, copy_base=False)
        if pack:
            pack_linears(model, head)
        if tree is None:  # the tree `draftheads tune-tree` chose for this device and dtype, if any
            tree = load_tuned_tree(head_dir, model.dtype, model.device)
        return cls(model, head, tokenizer, tree=tree, context=context, adaptive=adaptive)

    # ---- inputs -------------------------------------------------------------------------------

    def _prompt_ids(self, prompt) -> torch.Tensor:
        """(1, T) prompt ids from ids (list, (T,) or (1, T) tensor), text, or chat messages."""
        if isinstance(prompt, (str, list)) and (
            isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict))
        ):
            if self.tokenizer is None:
                raise ValueError(
                    "text or chat-message prompts need a tokenizer: SpeculativeGenerator(..., tokenizer=)"
                )
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = self.tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, return_dict=False
                )
            prompt = ids
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(
                f"speculative decoding runs one sequence at a time; got input_ids of shape {tuple(ids.shape)}"
            )
        if ids.shape[1] == 0:
            raise ValueError("the prompt is empty")
        if self.max_length is not None and ids.shape[1] >= self.max_length:
            raise ValueError(
                f"the prompt has {ids.shape[1]} tokens; the model's context is {self.max_length}"
            )
        return ids.to(self.model.device)

    # ---- the decode loop ----------------------------------------------------------------------

    @torch.no_grad()
    def _decode(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator,
        tally: _Tally,
    ) -> Iterator[list[int]]:
        """Yield the new tokens of each step (prefill, then one chunk per verification forward)."""
        model = self.model
        hidden_layers = () if self.head is None else tuple(self.head.feature_layers)
        prompt_length = input_ids.shape[1]
        limit = min(self.max_length or 2**62, prompt_length + max_new_tokens)  # final sequence length

        def emit(tokens: list[int]) -> tuple[list[int], bool]:
            """Cut ``tokens`` at the first EOS (kept) and at the length limits; report if done."""
            room = limit - prompt_length - tally.new_tokens
            for index, token in enumerate(tokens):
                if token in self.eos_ids:
                    tokens = tokens[: index + 1]
                    break
            done = len(tokens) >= room or (bool(tokens) and tokens[-1] in self.eos_ids)
            tokens = tokens[:room]
            tally.new_tokens += len(tokens)
            return tokens, done

        cache, output = prefill_forward(model, input_ids, hidden_layers)
        root = next_token(output.logits[0, -1], params, generator)
        tokens, done = emit([root])
        yield tokens
        if done:
            return
        if self.adaptive and self.cost is None:
            measuring = time.perf_counter()
            self._measure_cost(cache, root)
            tally.started += time.perf_counter() - measuring  # a one-time measurement, not decoding
        drafter = self.new_drafter()
        drafter.start(output.hidden_states, input_ids, root)
        past = prompt_length  # cache entries; the root sits at position `past`

        while True:
            # Node depth d lands at position past + d; accepting d drafts makes the sequence
            # past + d + 2 long, which must stay within the context: at its edge, verify the root alone.
            room = (self.max_length or 2**62) - past - 2
            draft = drafter.propose(root, past, self.tree.truncated(room)) if room > 0 else root_only(root)
            tokens_in_tree = draft.padded_tokens  # (N,)
            output = tree_forward(model, cache, tokens_in_tree, draft.topology, hidden_layers)
            acceptance = verify_tree(output.logits[0], tokens_in_tree, draft.topology, params, generator)
            accepted = torch.tensor(acceptance.nodes, device=tokens_in_tree.device)  # (A,)
            keep_accepted(cache, past, accepted)
            tally.record_step(acceptance.accepted_drafts)
            tally.record_sources(draft.sources, acceptance.nodes)
            drafter.record(draft, acceptance.nodes)
            new = tokens_in_tree[accepted[1:]].tolist() + [acceptance.next_token]
            tokens, done = emit(new)
            yield tokens
            if done:
                return
            features = drafter.select_features(output.hidden_states, accepted.to(model.device))  # (1, A, F)
            drafter.commit(features, torch.tensor([new], device=input_ids.device), past)  # (1, A) ids
            past += len(new)
            root = acceptance.next_token

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
    ) -> GenerationResult | TextStream:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``.

        Args:
            prompt: token ids (list, (T,) or (1, T) tensor), a string, or chat messages
                (``[{"role": "user", "content": ...}]``, formatted with the tokenizer's template).
            temperature: 0 is greedy (output identical to ``model.generate(do_sample=False)`` in fp32);
                above 0, the output follows the base model's sampling distribution after top_p/top_k.
            stream: return a ``TextStream`` yielding text as it is accepted (needs a tokenizer).
            seed: seeds the sampling generator (reproducible sampling).
            acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance, lossy).
        Returns:
            A ``GenerationResult`` (sequences, text, ``GenerationStats``), or a ``TextStream`` whose
            ``result`` holds it once exhausted. Generation stops after EOS (included), after
            ``max_new_tokens``, or at the model's context length.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, acceptance=acceptance)
        input_ids = self._prompt_ids(prompt)
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        if stream:
            if self.tokenizer is None:
                raise ValueError("stream=True needs a tokenizer to decode text")
            return TextStream(self._stream(input_ids, max_new_tokens, params, generator))
        tally = _Tally()
        new_tokens = [
            t for chunk in self._decode(input_ids, max_new_tokens, params, generator, tally) for t in chunk
        ]
        return self._result(input_ids, new_tokens, tally)

    def _result(self, input_ids: torch.Tensor, new_tokens: list[int], tally: _Tally) -> GenerationResult:
        sequences = torch.cat([input_ids.cpu(), torch.tensor([new_tokens], dtype=torch.long)], dim=1)
        text = (
            self.tokenizer.decode(new_tokens, skip_special_tokens=True)
            if self.tokenizer is not None
            else None
        )
        return GenerationResult(sequences, input_ids.shape[1], tally.stats(self.tree.name), text)

    def _stream(self, input_ids, max_new_tokens, params, generator):
        """Text pieces as steps are accepted; returns the GenerationResult at the end."""
        tally = _Tally()
        new_tokens: list[int] = []
        printed = ""
        for chunk in self._decode(input_ids, max_new_tokens, params, generator, tally):
            new_tokens.extend(chunk)
            text = self.tokenizer.decode(new_tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next byte
                continue
            if len(text) > len(printed):
                yield text[len(printed) :]
            printed = text
        return self._result(input_ids, new_tokens, tally)
