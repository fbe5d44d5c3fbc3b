"""KV-cache bookkeeping for tree verification, on transformers' own ``DynamicCache``.

After verifying a tree, the base cache holds prefix + all N tree nodes; only the accepted path's
entries may stay. ``keep_accepted`` moves them to the front of the tree region and crops the rest
(cheap at any prefix length, where re-indexing the whole cache grows with it: docs/inference.md,
"Measured facts the code relies on").
A batch's cache rows are described by their slots (B, L) bool, True where a slot holds one of the
row's entries: rows advance by different amounts, so a row may have free slots, which stay masked
(``keep_accepted_rows`` says where).

A drafter's cache is rolled back instead (its ``DynamicCache`` objects, ``head.draft_caches(cache)``:
one for EAGLE/EAGLE-3, one per module for MTP):
its tree entries were computed from the drafter's own predicted states, not from the base model's
features, so ``crop_to_lengths`` drops them all and the head's ``catch_up`` recomputes the accepted
positions from real features (as EAGLE does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose entries are the front of a buffer with room to spare: appending
    writes into the room instead of concatenating (``DynamicLayer.update`` copies the whole layer at
    every step, a copy that grows with the cache and the batch: docs/inference.md, "Measured facts
    the code relies on"). ``keys`` and ``values`` stay ordinary (B, H, L, D) tensors, views of the
    buffer, so everything that reads, crops or rewrites them in place works as on a
    ``DynamicLayer``; a layer whose tensors were replaced (rows selected) moves to a new buffer at
    its next update. The room doubles when it runs out, so a layer holds at most twice its
    entries."""

    min_room: int = 256  # slots beyond the entries when a buffer is (re)allocated

    def _has_room(self, extra: int) -> bool:
        buffer = getattr(self, "_key_buffer", None)
        keys = self.keys
        return (
            buffer is not None
            and keys.dim() == 4
            and keys.data_ptr() == buffer.data_ptr()
            and keys.shape[:2] == buffer.shape[:2]
            and keys.stride() == buffer.stride()
            and keys.shape[2] + extra <= buffer.shape[2]
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[2] if self.keys.dim() == 4 else 0
        new = key_states.shape[2]
        if not self._has_room(new):
            batch, heads, _, _ = key_states.shape
            capacity = max(2 * (length + new), length + new + self.min_room)
            keys = key_states.new_empty(batch, heads, capacity, key_states.shape[3])
            values = value_states.new_empty(batch, heads, capacity, value_states.shape[3])
            if length:
                keys[:, :, :length] = self.keys
                values[:, :, :length] = self.values
            self._key_buffer, self._value_buffer = keys, values
        self._key_buffer[:, :, length : length + new] = key_states
        self._value_buffer[:, :, length : length + new] = value_states
        self.keys = self._key_buffer[:, :, : length + new]
        self.values = self._value_buffer[:, :, : length + new]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def new_cache(model) -> DynamicCache:
    """An empty cache laid out for ``model``: one ``BufferedLayer`` per full-attention or
    sliding-window decoder layer (a sliding layer keeps every entry: its window is applied by the
    masks, ``draftheads.infer.window``), any other kind of layer as transformers lays it out
    (``_layers`` refuses those)."""
    cache = DynamicCache(config=model.config)
    kept_whole = (DynamicLayer, DynamicSlidingWindowLayer)
    cache.layers = [BufferedLayer() if type(layer) in kept_whole else layer for layer in cache.layers]
    return cache


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    """The cache's initialised layers; refuses layers a tree cannot be compacted in."""
    layers = []
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
            raise TypeError(
                f"cache layer {index} is a {type(layer).__name__}; tree decoding needs plain DynamicLayer "
                "caches (sliding-window and linear-attention layers cannot drop arbitrary tree entries)"
            )
        if layer.is_initialized and layer.keys.numel() > 0:
            layers.append(layer)
    return layers


def cache_lengths(caches: Sequence[DynamicCache]) -> tuple[int, ...]:
    """Entries held by each of a drafter's caches."""
    return tuple(cache.get_seq_length() for cache in caches)


def crop_to_lengths(caches: Sequence[DynamicCache], lengths: Sequence[int]) -> None:
    """Drop every entry after ``lengths`` (from ``cache_lengths``), in place."""
    if len(lengths) != len(caches):
        raise ValueError(f"expected {len(caches)} cache lengths, got {len(lengths)}")
    for cache, length in zip(caches, lengths):
        excess = cache.get_seq_length() - length
        if excess < 0:
            raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} entries to {length}")
        if excess:
            for layer in _layers(cache):
                layer.crop(-excess)


def keep_accepted(cache: DynamicCache, past_length: int, accepted: torch.Tensor) -> None:
    """Keep the prefix and the accepted tree nodes' entries, in path order; drop the other nodes.

    Args:
        cache: the base cache after verification: ``past_length`` prefix entries + the tree's N.
        past_length: entries before the tree.
        accepted: (A,) accepted node indices within the tree, ascending, starting at the root (0).
    """
    layers = _layers(cache)
    total = cache.get_seq_length()
    kept = accepted.numel()
    if kept == 0 or past_length + kept > total:
        raise ValueError(f"cannot keep {kept} tree entries after {past_length} in a cache of {total}")
    # A path through a tree listed parents-first has accepted[i] >= i, so when it is a plain prefix of
    # the tree only the crop is needed; otherwise gather (a copy) and write the front of the tree region.
    contiguous = bool((accepted.cpu() == torch.arange(kept)).all())
    if not contiguous:
        index = (past_length + accepted).to(layers[0].keys.device)  # (A,)
        for layer in layers:
            layer.keys[:, :, past_length : past_length + kept] = layer.keys.index_select(2, index)
            layer.values[:, :, past_length : past_length + kept] = layer.values.index_select(2, index)
    excess = total - past_length - kept
    if excess:
        for layer in layers:
            layer.crop(-excess)


def left_aligned_slots(lengths: Sequence[int], total: int) -> torch.Tensor:
    """(B, total) bool: row b's entries in its first ``lengths[b]`` slots of a batch's cache (the
    layout ``forward.prefill_rows`` leaves)."""
    if any(not 0 <= length <= total for length in lengths):
        raise ValueError(f"row lengths {list(lengths)} do not fit a cache of {total} slots")
    return torch.arange(total)[None] < torch.tensor(list(lengths), dtype=torch.long)[:, None]


def slot_ends(slots: torch.Tensor) -> list[int]:
    """Per row, the slot after its last occupied one (0 for a row with none)."""
    positions = torch.arange(1, slots.shape[1] + 1)
    return (slots * positions).amax(dim=1).tolist() if slots.shape[1] else [0] * slots.shape[0]


# Free slots a batch's cache may hold beyond its longest row before ``keep_accepted_rows``
# squeezes them out: steps in which every row accepts only its root leave the shorter rows' free
# slots in place, and in a batch that drafts such steps recur.
MAX_FREE_SLOTS = 64


def squeeze_rows(cache: DynamicCache, slots: torch.Tensor) -> torch.Tensor:
    """Move every row's entries to its first slots, in order, and crop the cache to the longest
    row (one gather per cache tensor); returns the new slots, left-aligned."""
    lengths = slots.sum(dim=1)
    longest = int(lengths.max())
    order = torch.argsort((~slots).to(torch.int8), dim=1, stable=True)[:, :longest]  # occupied first
    layers = _layers(cache)
    if layers:
        device = layers[0].keys.device
        rows = torch.arange(slots.shape[0], device=device)[:, None]  # (B, 1)
        order = order.to(device)  # (B, longest)
        for layer in layers:
            # advanced indices around a slice put their dims first: (B, longest, H, D)
            layer.keys = layer.keys[rows, :, order].transpose(1, 2).contiguous()
            layer.values = layer.values[rows, :, order].transpose(1, 2).contiguous()
    return left_aligned_slots(lengths.tolist(), longest)


def keep_accepted_rows(
    cache: DynamicCache, slots: torch.Tensor, accepted: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``_keep_accepted_rows``, then ``squeeze_rows`` when the cache holds more than
    ``MAX_FREE_SLOTS`` slots beyond its longest row."""
    slots = _keep_accepted_rows(cache, slots, accepted)
    if slots.shape[1] - int(slots.sum(dim=1).max()) > MAX_FREE_SLOTS:
        slots = squeeze_rows(cache, slots)
    return slots


def _keep_accepted_rows(
    cache: DynamicCache, slots: torch.Tensor, accepted: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``keep_accepted`` for a batch: which of the cache's slots hold each row's entries is
    ``slots`` (B, L) (True where occupied; the tree's entries follow, from slot L). Returns the
    slots after keeping each row's accepted path.

    A step in which every row accepted its root alone (a plain batched decoding step, or a drafting
    step that accepted nothing) moves nothing: each root stays in the tree's first slot, behind
    whatever free slots its row has (they stay masked), and the cache grows by one slot, as batched
    ``generate``'s does with left padding. Otherwise each row's path moves to just after its last
    occupied slot (a path already there, such as a tree's prefix in a row as long as the cache,
    does not move), and the cache is cropped to the longest row; a row's free slots before its
    entries stay free.

    Args:
        slots: (B, L) bool, L = the cache length before verification.
        accepted: per row, (A_b,) accepted node indices, ascending, starting at the root (0).
    """
    batch, tree_start = slots.shape
    layers = _layers(cache)
    total = cache.get_seq_length()
    nodes = [a.tolist() for a in accepted]
    kept = [len(path) for path in nodes]
    if len(nodes) != batch or min(kept) == 0 or max(path[-1] for path in nodes) >= total - tree_start:
        raise ValueError(
            f"cannot keep {kept} tree entries of {batch} rows after {tree_start} in a cache of {total}"
        )
    if max(kept) == 1:  # every row its root alone: nothing moves
        crop_to_lengths([cache], [tree_start + 1])
        return torch.cat([slots, torch.ones(batch, 1, dtype=torch.bool)], dim=1)
    if batch == 1 and bool(slots.all()):
        keep_accepted(cache, tree_start, accepted[0])
        return torch.ones(1, tree_start + kept[0], dtype=torch.bool)
    ends = slot_ends(slots)
    new_ends = [end + count for end, count in zip(ends, kept)]
    # Per row, source and destination slots, padded to the longest path by repeating the row's last
    # pair (the same write twice). A row whose path already sits where it belongs needs no move
    # (the longest rows in a step that accepts a tree's prefix); if no row needs one, only the crop
    # is left.
    width = max(kept)
    source = [[tree_start + n for n in path + path[-1:] * (width - len(path))] for path in nodes]
    destination = [
        list(range(end, end + len(path))) + [end + len(path) - 1] * (width - len(path))
        for end, path in zip(ends, nodes)
    ]
    moving = [b for b in range(batch) if source[b] != destination[b]]
    if moving:
        device = layers[0].keys.device
        rows = torch.tensor(moving, device=device)[:, None]  # (M, 1)
        source_slots = torch.tensor([source[b] for b in moving], device=device)  # (M, width)
        destination_slots = torch.tensor([destination[b] for b in moving], device=device)
        for layer in layers:
            for name in ("keys", "values"):
                tensor = getattr(layer, name)  # (B, H, L, D); advanced indices give (M, width, H, D)
                tensor[rows, :, destination_slots] = tensor[rows, :, source_slots]
    length = max(new_ends)
    crop_to_lengths([cache], [length])
    new_slots = torch.zeros(batch, length, dtype=torch.bool)
    before = min(tree_start, length)
    new_slots[:, :before] = slots[:, :before]
    columns = torch.arange(length)[None]
    ends_tensor, new_ends_tensor = torch.tensor(ends)[:, None], torch.tensor(new_ends)[:, None]
    new_slots |= (columns >= ends_tensor) & (columns < new_ends_tensor)
    return new_slots


def select_rows(cache: DynamicCache, slots: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Keep only the batch rows ``rows`` (in that order), cropped to the slots they occupy, in
    place; returns their slots."""
    slots = slots[list(rows)]
    length = max(slot_ends(slots))
    index = None
    for layer in _layers(cache):
        if index is None:
            index = torch.tensor(list(rows), dtype=torch.long, device=layer.keys.device)
        layer.keys = layer.keys.index_select(0, index)[:, :, :length]
        layer.values = layer.values.index_select(0, index)[:, :, :length]
    return slots[:, :length]


def add_rows(
    cache: DynamicCache, slots: torch.Tensor, new: DynamicCache, new_slots: torch.Tensor
) -> torch.Tensor:
    """Append the rows of cache ``new`` (their slots ``new_slots``, (B_new, L_new)) after the
    batch's own rows of ``cache`` (``slots``, (B, L)), in place; returns the slots of all rows.
    The shorter side gains free slots at its end (zeros, masked as every free slot is), so each row
    keeps its entries where they were and the next tree follows the longest row, as after
    ``keep_accepted_rows``."""
    layers, extra = _layers(cache), _layers(new)
    if len(layers) != len(extra):
        raise ValueError(f"cannot add rows of a cache with {len(extra)} layers to one with {len(layers)}")
    if slots.shape[1] != cache.get_seq_length() or new_slots.shape[1] != new.get_seq_length():
        raise ValueError(
            f"slots for {slots.shape[1]} and {new_slots.shape[1]} entries, but the caches hold "
            f"{cache.get_seq_length()} and {new.get_seq_length()}"
        )
    length = max(slots.shape[1], new_slots.shape[1])

    def padded(tensor: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B, H, length, D)
        return torch.nn.functional.pad(tensor, (0, 0, 0, length - tensor.shape[2]))

    for layer, other in zip(layers, extra):
        layer.keys = torch.cat([padded(layer.keys), padded(other.keys)])
        layer.values = torch.cat([padded(layer.values), padded(other.values)])
    return torch.cat(
        [
            torch.nn.functional.pad(slots, (0, length - slots.shape[1])),
            torch.nn.functional.pad(new_slots, (0, length - new_slots.shape[1])),
        ]
    )
