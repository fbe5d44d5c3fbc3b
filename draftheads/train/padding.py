"""How much of a run's compute goes to padding, and to ranks waiting for each other.

A micro-batch computes B x (its longest row) token positions; the rows' real tokens are what
trains. Data-parallel ranks then meet at every gradient all-reduce, so at each step every rank
waits for the one whose micro-batch is longest. Both are read off the epoch order the training
loop itself uses (``batching.epoch_batches``), counting token positions (the attention's quadratic
term aside).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draftheads.train.batching import epoch_batches


@dataclass(frozen=True)
class PaddingReport:
    """One epoch's token positions: real, computed (with padding) and held by ranks (with waiting)."""

    micro_batch_size: int
    ranks: int
    tokens: int  # real tokens
    computed: int  # sum over micro-batches of B x its longest row
    held: int  # sum over steps of ranks x the step's largest micro-batch

    @property
    def padding(self) -> float:
        """The fraction of computed positions that are padding."""
        return 1 - self.tokens / self.computed if self.computed else 0.0

    @property
    def waiting(self) -> float:
        """The fraction of the ranks' time spent waiting for a longer micro-batch at a step."""
        return 1 - self.computed / self.held if self.held else 0.0

    def line(self) -> str:
        return (
            f"padding: {self.padding:.1%} of the positions micro-batches of {self.micro_batch_size} compute; "
            f"{self.ranks} rank(s) wait {self.waiting:.1%} of a step for the longest micro-batch"
        )


def padding_report(
    lengths: Sequence[int], micro_batch_size: int, ranks: int, seed: int, group_by_length: bool = True
) -> PaddingReport:
    """The report of epoch 0 of rows of ``lengths`` tokens, dealt as the training loop deals them:
    global micro-batch k to rank k mod ``ranks``, a step being ``ranks`` consecutive micro-batches."""
    if micro_batch_size < 1 or ranks < 1:
        raise ValueError(f"micro_batch_size and ranks must be >= 1, got {micro_batch_size} and {ranks}")
    batches = epoch_batches(lengths, micro_batch_size, seed, 0, group_by_length)
    computed = [len(rows) * max(lengths[row] for row in rows) for rows in batches]
    held = sum(ranks * max(computed[start : start + ranks]) for start in range(0, len(computed), ranks))
    return PaddingReport(micro_batch_size, ranks, sum(lengths), sum(computed), held)
