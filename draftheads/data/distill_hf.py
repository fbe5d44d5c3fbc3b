"""In-process distillation engine: continuous batching on the unmodified Hugging Face model.

``model.generate`` on a left-padded batch decodes until its longest answer ends: rows whose answer
ended early idle, every row attends over the batch's padding, and ``DynamicCache`` copies the whole
cache at every step (``torch.cat``). Here a fixed number of slots decode together and a slot whose
answer ends takes the next turn from the queue at once (continuous batching, as in Orca, Yu et al.,
OSDI 2022, and vLLM). The KV cache is preallocated per slot (``SlotCache``): each slot holds its
sequence from position 0, a step writes one entry per slot in place, and attention reads the
first ``width`` entries under a 4D mask that hides what a slot does not own. New turns are prefilled
straight into their slots, right-padded, in groups of similar length (``prefill_groups``), so that
a short prompt does not pad to a long one's length.

Greedy answers are the base model's greedy answers: each row sees exactly its own prompt and
tokens at their own positions (``tests/data/test_distill_hf.py`` compares with ``model.generate``).
A 4D mask reaches every layer unchanged, so for a base with sliding-window layers (Gemma 3) the
forwards pass {layer type: mask}, the sliding one also blocking keys ``sliding_window`` or more
positions behind their query (``draftheads.infer.window``, where verification does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from draftheads.compat import cache_kwargs
from draftheads.config import DistillConfig
from draftheads.data.distill import Turn, TurnQueue
from draftheads.infer.window import layer_types, masks_by_type

CAPACITY_STEP = 64  # slot capacity grows in steps of this many entries (rarely: turns come shortest first)
# What one more prefill forward costs beyond its tokens, in prompt tokens: a forward streams every
# weight once (the cost of a decode step), about as long as a dozen prompt tokens of a batched prefill
# take for SmolLM2-135M in fp32 on a CPU. It decides only how prompts are grouped, never an answer
# (the engine's throughput: docs/training.md, "Data").
FORWARD_TOKENS = 12


def prefill_groups(lengths: list[int], forward_tokens: int = FORWARD_TOKENS) -> list[list[int]]:
    """Split prompts into right-padded prefill forwards: indices into ``lengths``, each group sorted
    by length, minimising the tokens computed (rows x longest, padding included) plus
    ``forward_tokens`` for each forward. Contiguous runs of the sorted lengths are optimal for this
    cost; found exactly by dynamic programming (a few dozen prompts at most)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    ordered = [lengths[i] for i in order]
    best = [0] + [None] * len(order)  # best[j]: cost of the first j prompts
    cut = [0] * (len(order) + 1)
    for stop in range(1, len(order) + 1):
        for start in range(stop):
            cost = best[start] + forward_tokens + (stop - start) * ordered[stop - 1]
            if best[stop] is None or cost < best[stop]:
                best[stop], cut[stop] = cost, start
    groups, stop = [], len(order)
    while stop:
        groups.append(order[cut[stop] : stop])
        stop = cut[stop]
    return groups[::-1]


@dataclass
class Write:
    """Where a forward's new entries go: row b's q entries at ``positions[b]`` onward in slot
    ``rows[b]`` (``rows`` None: every slot, in order); attention then reads ``width`` entries."""

    rows: torch.Tensor | None  # (k,) slot indices
    positions: torch.Tensor  # (k,)
    width: int


class SlotLayer(CacheLayerMixin):
    """One decoder layer's keys and values, (slots, H, capacity, D), written in place."""

    is_sliding = False

    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros(self.slots, heads, 0, dim)
        self.values = value_states.new_zeros(self.slots, heads, 0, value_states.shape[-1])
        self.is_initialized = True

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` entries per slot, keeping what is there."""
        if capacity <= self.keys.shape[2]:
            return
        capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states, value_states, write: Write | None = None, *args, **kwargs):
        """Write (k, H, q, D) states where ``write`` says; return (k, H, width, D) keys and values."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        self.reserve(int(write.positions.max()) + query_length)
        rows = write.rows if write.rows is not None else torch.arange(self.slots)
        if query_length == 1:
            self.keys[rows, :, write.positions] = key_states[:, :, 0]
            self.values[rows, :, write.positions] = value_states[:, :, 0]
        else:  # a prefill: every row from position 0
            self.keys[rows, :, :query_length] = key_states
            self.values[rows, :, :query_length] = value_states
            return key_states, value_states
        if write.rows is None:
            return self.keys[:, :, : write.width], self.values[:, :, : write.width]
        return self.keys[write.rows, :, : write.width], self.values[write.rows, :, : write.width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("SlotCache forwards take a prepared 4D attention mask")

    def get_seq_length(self) -> int:
        raise NotImplementedError("SlotCache forwards take explicit position_ids")

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """A KV cache of ``slots`` independent sequences for one model; ``write`` is set before each
    forward (``ContinuousBatcher``), which must pass a 4D mask and position_ids."""

    def __init__(self, num_layers: int, slots: int):
        super().__init__(layers=[SlotLayer(slots) for _ in range(num_layers)])
        self.write: Write | None = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, self.write)


@dataclass
class Row:
    """A slot's turn in progress."""

    key: int
    length: int  # entries in the slot's cache (prompt + fed tokens)
    limit: int  # new tokens allowed
    new_ids: list[int] = field(default_factory=list)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """End-of-sequence ids, as ``model.generate`` stops on them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return frozenset(() if eos is None else [eos] if isinstance(eos, int) else eos)


class ContinuousBatcher:
    """Answer a ``TurnQueue``'s turns with ``model``, ``config.batch_size`` slots decoding together.

    ``config.temperature`` 0 is greedy; above 0, plain temperature sampling (no top-p / top-k, as
    ``distill`` has always sampled), seeded by ``seed``.
    """

    def __init__(self, model, tokenizer, config: DistillConfig, seed: int = 0):
        self.model = model
        self.slots = config.batch_size
        self.max_new_tokens = config.max_new_tokens
        self.temperature = config.temperature
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generator = torch.Generator().manual_seed(seed)
        self.masked = torch.finfo(model.dtype).min
        layer_types(model.config)  # refuses, before any turn, layers no mask is made for

    def _masks(self, visible: torch.Tensor, query_positions: torch.Tensor):
        """(k, Q, K) bool "may attend" over cache entries 0..K-1 (an entry's index is its position),
        queries at (k, Q) ``query_positions`` -> the ``attention_mask`` a forward takes: one additive
        (k, 1, Q, K) mask, or {layer type: mask} where sliding and full layers mix."""
        mask = torch.zeros(visible.shape, dtype=self.model.dtype).masked_fill_(~visible, self.masked)
        mask = mask[:, None].to(self.model.device)  # (k, 1, Q, K)
        keys = torch.arange(visible.shape[-1]).expand(visible.shape[0], -1)  # (k, K)
        return masks_by_type(self.model.config, mask, query_positions, keys)

    def _next_tokens(self, logits: torch.Tensor) -> list[int]:
        """(k, V) logits -> one token per row."""
        if self.temperature == 0:
            return logits.argmax(-1).tolist()
        probabilities = torch.softmax(logits.float() / self.temperature, dim=-1)
        return torch.multinomial(probabilities.cpu(), 1, generator=self.generator)[:, 0].tolist()

    def _prefill(self, cache: SlotCache, turns: list[tuple[int, Turn]]) -> list[int]:
        """Each turn's prompt into its slot, in right-padded forwards of similar lengths; the first
        new tokens, in the order of ``turns``."""
        tokens = [0] * len(turns)
        for group in prefill_groups([len(turn.prompt_ids) for _, turn in turns]):
            for index, token in zip(group, self._prefill_together(cache, [turns[i] for i in group])):
                tokens[index] = token
        return tokens

    def _prefill_together(self, cache: SlotCache, turns: list[tuple[int, Turn]]) -> list[int]:
        """Each turn's prompt into its slot, in one right-padded forward; the first new tokens."""
        lengths = torch.tensor([len(t.prompt_ids) for _, t in turns])
        longest = int(lengths.max())
        input_ids = torch.full((len(turns), longest), self.pad_id, dtype=torch.long)
        for b, (_, turn) in enumerate(turns):
            input_ids[b, : len(turn.prompt_ids)] = torch.tensor(turn.prompt_ids)
        positions = torch.arange(longest)
        visible = (positions[None, :] <= positions[:, None])[None] & (
            positions[None, None, :] < lengths[:, None, None]
        )
        mask = self._masks(visible, positions.expand(len(turns), -1))
        last = lengths - 1
        keep = torch.unique(last)  # ascending: the positions whose logits are needed
        cache.write = Write(
            torch.tensor([slot for slot, _ in turns]), torch.zeros(len(turns), dtype=torch.long), longest
        )
        device = self.model.device
        output = self.model(
            input_ids=input_ids.to(device),
            attention_mask=mask,  # (k, 1, T, T), or one per layer type
            position_ids=positions.expand(len(turns), -1).to(device),
            **cache_kwargs(cache),
            use_cache=True,
            logits_to_keep=keep.to(device),
        )
        column = torch.searchsorted(keep, last)
        return self._next_tokens(output.logits[torch.arange(len(turns)), column.to(output.logits.device)])

    def _step(self, cache: SlotCache, rows: list[Row | None], every_slot: bool) -> list[int]:
        """One decode step for the live slots (or every slot, idle ones computing nothing useful):
        the next token of each slot stepped, in slot order."""
        slots = range(self.slots) if every_slot else [s for s, row in enumerate(rows) if row is not None]
        lengths = torch.tensor([rows[s].length if rows[s] is not None else 0 for s in slots])  # (k,)
        last = [rows[s].new_ids[-1] if rows[s] is not None else self.pad_id for s in slots]
        width = int(lengths.max()) + 1
        visible = torch.arange(width)[None, :] <= lengths[:, None]  # (k, width): own entries + the new one
        mask = self._masks(visible[:, None], lengths[:, None])
        cache.write = Write(None if every_slot else torch.tensor(list(slots)), lengths, width)
        device = self.model.device
        output = self.model(
            input_ids=torch.tensor(last)[:, None].to(device),
            attention_mask=mask,  # (k, 1, 1, width), or one per layer type
            position_ids=lengths[:, None].to(device),
            **cache_kwargs(cache),
            use_cache=True,
        )
        tokens = self._next_tokens(output.logits[:, -1])
        return [token for s, token in zip(slots, tokens) if rows[s] is not None]

    def _extend(self, queue: TurnQueue, rows: list[Row | None], slot: int, token: int) -> None:
        """Append ``token`` to the slot's answer; a finished answer goes back to the queue."""
        row = rows[slot]
        row.new_ids.append(token)
        if token in self.eos_ids or len(row.new_ids) >= row.limit:
            queue.give(row.key, row.new_ids)
            rows[slot] = None

    @torch.inference_mode()
    def run(self, queue: TurnQueue) -> None:
        """Answer every turn ``queue`` hands out, until it has none left."""
        cache = SlotCache(self.model.config.num_hidden_layers, self.slots)
        rows: list[Row | None] = [None] * self.slots
        while True:
            turns = []
            for slot in (s for s, row in enumerate(rows) if row is None):
                turn = queue.take()
                if turn is None:
                    break
                turns.append((slot, turn))
            if turns:
                for (slot, turn), token in zip(turns, self._prefill(cache, turns)):
                    rows[slot] = Row(turn.key, len(turn.prompt_ids), self.max_new_tokens)
                    self._extend(queue, rows, slot, token)
            live = [s for s, row in enumerate(rows) if row is not None]
            if not live:
                if turns:
                    continue  # every new turn ended at its first token: take more
                return
            # Idle slots cost one row each; selecting the live rows copies their caches every step.
            tokens = self._step(cache, rows, every_slot=2 * len(live) >= self.slots)
            for slot, token in zip(live, tokens):
                rows[slot].length += 1
                self._extend(queue, rows, slot, token)
