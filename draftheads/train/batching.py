"""Length-grouped batching, padding collate, and a resumable stream of micro-batches.

Examples of similar length share a batch so little compute goes to padding (the grouping of HF
``LengthGroupedSampler``: shuffle, cut into mega-batches, sort each by length, shuffle the
batches, here in blocks of ``RANK_BLOCK`` so the ranks of a step get batches of similar length).
Every order is a pure function of (seed, epoch), so a run's data position is one integer and
resuming replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from draftheads.data.pipeline import row_lengths
from draftheads.train.draws import row_seeds

# Batches per sorted mega-batch: local length groups, still a shuffled epoch. Large enough that a
# block of RANK_BLOCK batches spans a narrow band of lengths, and a multiple of RANK_BLOCK, so that
# blocks, and with them the steps of W ranks (W dividing RANK_BLOCK), never straddle two mega-batches.
MEGABATCH_FACTOR = 512
# Neighbouring batches of a sorted mega-batch that stay together when the batches are shuffled.
# Rank r takes global micro-batches r, r + W, ...: with W dividing RANK_BLOCK, the W micro-batches
# of a step come from one block, of about one length, so ranks do not wait for each other at the
# gradient all-reduce (``draftheads.train.padding`` measures it). A constant, not W: the order of
# a run must not depend on its world size, which a resumed run may change.
RANK_BLOCK = 32


def epoch_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, group_by_length: bool = True
) -> list[list[int]]:
    """Row indices of every batch of one epoch, in order (the last batch may be smaller).

    Args:
        lengths: (N,) token count of each row.
        batch_size: rows per batch.
        seed, epoch: the order is a deterministic function of both.
        group_by_length: sort rows by length inside each mega-batch of ``batch_size * MEGABATCH_FACTOR``
            rows, and shuffle blocks of ``RANK_BLOCK`` batches.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not group_by_length:
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    megabatch = batch_size * MEGABATCH_FACTOR
    blocks: list[list[list[int]]] = []
    for start in range(0, len(order), megabatch):
        group = sorted(order[start : start + megabatch], key=lambda i: -lengths[i])
        batches = [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
        blocks.extend(batches[i : i + RANK_BLOCK] for i in range(0, len(batches), RANK_BLOCK))
    # Shuffle blocks of neighbouring batches, so lengths do not fall steadily within each
    # mega-batch while the ranks of one step still get batches of about one length.
    permutation = torch.randperm(len(blocks), generator=generator).tolist()
    return [batch for i in permutation for batch in blocks[i]]


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


class BatchStream:
    """Endless, resumable micro-batches over a dataset, dealt round-robin to data-parallel ranks.

    All ranks walk one global sequence: epoch 0's batches, then epoch 1's, ... (each epoch a
    ``epoch_batches`` order, every batch in it). Rank r of W takes global micro-batches r, r + W,
    r + 2W, ...: ranks never share a batch, together they cover every batch of every epoch, and
    the k-th micro-batch a rank reads is global micro-batch ``k * W + r`` whatever W is, so W ranks
    x A accumulation steps read the batches that one process reads with W * A accumulation steps,
    in the same order. The position is one count (micro-batches this rank has read). Each batch
    carries its rows' dataset indices ``row_index`` (B,) and its ``epoch`` (a 0-dim tensor): with
    the run's seed, what a row's random draws in training are a function of (``draws.row_seeds``).
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
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.dataset = dataset
        self.lengths = row_lengths(dataset)
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.group_by_length = group_by_length
        self.rank = rank
        self.world_size = world_size
        self.read = 0  # micro-batches this rank has read
        self._epoch_cache: tuple[int, list[list[int]]] | None = None

    def batches_per_epoch(self) -> int:
        """Micro-batches in one epoch, all ranks together."""
        return -(-len(self.lengths) // self.batch_size)

    def global_index(self, read: int | None = None) -> int:
        """The global micro-batch this rank reads as its ``read``-th (default: its next one)."""
        return (self.read if read is None else read) * self.world_size + self.rank

    def batch_rows(self, global_index: int) -> list[int]:
        """Dataset rows of global micro-batch ``global_index``."""
        epoch, index = divmod(global_index, self.batches_per_epoch())
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            batches = epoch_batches(self.lengths, self.batch_size, self.seed, epoch, self.group_by_length)
            self._epoch_cache = (epoch, batches)
        return self._epoch_cache[1][index]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        global_index = self.global_index()
        indices = self.batch_rows(global_index)
        self.read += 1
        batch = with_row_index(collate([self.dataset[i] for i in indices], self.pad_token_id), indices)
        epoch = global_index // self.batches_per_epoch()
        # Each row's random draws are a function of (seed, epoch, dataset row, position) alone,
        # whatever its rank, micro-batch slot or padding (draftheads.train.draws).
        return {**batch, "epoch": torch.tensor(epoch), "sample_seed": row_seeds(self.seed, epoch, indices)}

    def state_dict(self) -> dict[str, int]:
        """The position, with the world size it counts in (a checkpoint resumes only with it)."""
        return {"micro_batches_read": self.read, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int], where: str = "data position") -> None:
        """Continue from ``state_dict()``; refuses a position counted in another world size."""
        if "micro_batches_read" not in state:  # written before the world size was recorded
            if self.world_size != 1:
                raise ValueError(
                    f"{where}: {state} predates multi-process positions; resume it with one process"
                )
            state = {
                "micro_batches_read": int(state["epoch"]) * self.batches_per_epoch() + int(state["index"])
            }
            state["world_size"] = 1
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"{where}: written by {state['world_size']} data-parallel processes, resumed with "
                f"{self.world_size}; resume with {state['world_size']}"
            )
        self.read = int(state["micro_batches_read"])


def with_host_inputs(batch: dict, prepare: Callable[[dict], dict]) -> dict:
    """A host ``batch`` with what ``prepare(batch)`` adds (``Recipe.host_inputs``: what the step
    scores, a feature cache's rows), made here, where reading values makes nothing wait for a
    device: on a GPU the host reads the next batch while the device runs the queued one."""
    moved = sorted(name for name, tensor in batch.items() if tensor.device.type != "cpu")
    if moved:
        raise ValueError(f"with_host_inputs: a host batch's tensors, got {moved} on a device")
    return {**batch, **prepare(batch)}


def to_device(batch: dict, device: torch.device) -> dict:
    """A host batch's tensors (and its supervision) on ``device``. Towards a GPU they are pinned
    first, so the copies queue behind the device's work without the host waiting."""
    pin = device.type == "cuda"
    return {
        name: (value.pin_memory() if pin else value).to(device, non_blocking=True)
        for name, value in batch.items()
    }


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The real (not padding) tokens of a host batch."""
    return int(batch["attention_mask"].sum())


def fixed_batches(
    dataset, batch_size: int, pad_token_id: int, seed: int, limit: int | None = None
) -> list[dict]:
    """Evaluation batches: one length-grouped epoch order for ``seed``, first ``limit`` batches.

    The batches are shuffled one by one (not in ``RANK_BLOCK`` blocks of one length band), which
    keeps a limited evaluation representative; the order depends only on ``seed``, so every
    evaluation of a run sees the same batches.
    """
    lengths = row_lengths(dataset)
    groups = epoch_batches(lengths, batch_size, seed, epoch=0, group_by_length=True)
    permutation = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    groups = [groups[i] for i in permutation]
    if limit is not None:
        groups = groups[:limit]
    return [with_row_index(collate([dataset[i] for i in group], pad_token_id), group) for group in groups]
