"""Length-grouped batching, padding collate, and a resumable stream of micro-batches.

Examples of similar length share a batch so little compute goes to padding (the grouping of HF
``LengthGroupedSampler``: shuffle, cut into mega-batches, sort each by length, shuffle the
batches). Every order is a pure function of (seed, epoch), so a run's data position is two
integers and resuming replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MEGABATCH_FACTOR = 50  # batches per sorted mega-batch: local length groups, still a shuffled epoch


def epoch_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, group_by_length: bool = True
) -> list[list[int]]:
    """Row indices of every batch of one epoch, in order (the last batch may be smaller).

    Args:
        lengths: (N,) token count of each row.
        batch_size: rows per batch.
        seed, epoch: the order is a deterministic function of both.
        group_by_length: sort rows by length inside each mega-batch of ``batch_size * 50`` rows.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    megabatch = batch_size * MEGABATCH_FACTOR
    batches: list[list[int]] = []
    for start in range(0, len(order), megabatch):
        group = sorted(order[start : start + megabatch], key=lambda i: -lengths[i])
        batches.extend(group[i : i + batch_size] for i in range(0, len(group), batch_size))
    # Shuffle the batches so lengths do not fall steadily within each mega-batch.
    permutation = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in permutation]


def collate(rows: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows with ``input_ids`` and ``loss_mask`` to the longest row.

    Returns ``input_ids`` (B, T), ``attention_mask`` (B, T) and ``loss_mask`` (B, T); padding has
    attention 0 and loss 0.
    """
    if not rows:
        raise ValueError("collate: empty batch")
    longest = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)  # (B, T)
    loss_mask = torch.zeros((len(rows), longest), dtype=torch.long)  # (B, T)
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        if len(row["loss_mask"]) != length:
            raise ValueError(
                f"row {row.get('id', index)!r}: loss_mask has {len(row['loss_mask'])} entries "
                f"for {length} input_ids"
            )
        input_ids[index, :length] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        attention_mask[index, :length] = 1
        loss_mask[index, :length] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def with_row_index(batch: dict[str, torch.Tensor], indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Add ``row_index`` (B,): the dataset rows of the batch (offline training reads their cached
    hidden states by it)."""
    return {**batch, "row_index": torch.tensor(list(indices), dtype=torch.long)}


def _row_lengths(dataset) -> list[int]:
    # The data pipeline stores a ``length`` column; reading it avoids decoding every input_ids row.
    if "length" in getattr(dataset, "column_names", ()):
        return [int(length) for length in dataset["length"]]
    return [len(ids) for ids in dataset["input_ids"]]


@dataclass
class DataPosition:
    """Where the stream is: the next micro-batch is batch ``index`` of ``epoch`` (this rank's)."""

    epoch: int = 0
    index: int = 0


class BatchStream:
    """Endless, resumable micro-batches over a dataset, sharded across data-parallel ranks.

    Every rank computes the same epoch order and takes every ``world_size``-th batch, so ranks
    never share a batch; each epoch is cut to a multiple of ``world_size`` batches so all ranks
    step together.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        pad_token_id: int,
        seed: int,
        group_by_length: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        if len(dataset) == 0:
            raise ValueError("cannot batch an empty dataset")
        self.dataset = dataset
        self.lengths = _row_lengths(dataset)
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.group_by_length = group_by_length
        self.rank = rank
        self.world_size = world_size
        self.position = DataPosition()
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def batches_per_epoch(self) -> int:
        """Micro-batches this rank sees per epoch."""
        total = -(-len(self.lengths) // self.batch_size)
        return max(1, total // self.world_size)

    def rank_batches(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            batches = epoch_batches(self.lengths, self.batch_size, self.seed, epoch, self.group_by_length)
            if len(batches) < self.world_size:  # fewer batches than ranks: repeat so each rank has one
                batches = (batches * self.world_size)[: self.world_size]
            usable = len(batches) - len(batches) % self.world_size
            self._epoch_cache = (epoch, batches[self.rank : usable : self.world_size])
        return self._epoch_cache[1]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batches = self.rank_batches(self.position.epoch)
        if self.position.index >= len(batches):
            self.position = DataPosition(self.position.epoch + 1, 0)
            batches = self.rank_batches(self.position.epoch)
        indices = batches[self.position.index]
        self.position = DataPosition(self.position.epoch, self.position.index + 1)
        return with_row_index(collate([self.dataset[i] for i in indices], self.pad_token_id), indices)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "index": self.position.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = DataPosition(int(state["epoch"]), int(state["index"]))


def fixed_batches(
    dataset, batch_size: int, pad_token_id: int, seed: int, limit: int | None = None
) -> list[dict]:
    """Evaluation batches: one length-grouped epoch order for ``seed``, first ``limit`` batches.

    A shuffled (not longest-first) order keeps a limited evaluation representative; it depends
    only on ``seed``, so every evaluation of a run sees the same batches.
    """
    lengths = _row_lengths(dataset)
    groups = epoch_batches(lengths, batch_size, seed, epoch=0, group_by_length=True)
    if limit is not None:
        groups = groups[:limit]
    return [with_row_index(collate([dataset[i] for i in group], pad_token_id), group) for group in groups]
