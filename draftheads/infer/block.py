"""The Drafter of block heads (DFlash; Chen et al. 2026, arXiv 2602.06036): one head forward per
step drafts every depth of the tree at once.

The head's block at the root position gives K - 1 distributions (depth d = block row d), all from
one forward conditioned on the committed features; they fill a static tree exactly as Medusa's K
heads do (``ParallelDrafter``: the node at path [i1, ..., id] gets the i_d-th best token of depth
d), so only where the distributions come from differs. Unlike Medusa's, they depend on the root
token (it is the block's first row), so they are kept for one (root, position), not for one commit.
``propose_steps`` yields the forward as a ``BlockForward``, which a batch runs for all its rows at
once (``draftheads.infer.batch_draft``).

State: the head's context cache (one ``DynamicCache``, the context rows of the committed positions)
and the features committed since the last block, which the next block's forward appends to the cache
in the same pass. Cost per step: one forward over (new context rows + K block rows), whatever the
tree's depth.
"""

from __future__ import annotations

import copy

import torch

from draftheads.infer.draft import BlockForward, ParallelDrafter, register_drafter


@register_drafter("block")
class BlockDrafter(ParallelDrafter):
    def __init__(self, head, pad_to_multiple: int = 1):
        super().__init__(head, pad_to_multiple)
        self.cache = None  # the head's context cache, positions 0 .. committed - len(pending) - 1
        self.pending: list[torch.Tensor] = []  # (1, n, F) features committed, not yet in the cache
        self.committed = 0  # positions whose features were committed
        self.block: tuple[int, int, torch.Tensor] | None = None  # (root, position, (K - 1, V) logits)

    def fork(self) -> BlockDrafter:
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        other.pending = list(self.pending)
        return other

    def prefill(self, features, next_ids) -> None:
        self.cache = self.head.new_cache()
        self.pending, self.committed, self.block = [], 0, None
        if features.shape[1]:
            self.commit(features, next_ids, 0)

    def commit(self, features, next_ids, position) -> None:
        if position != self.committed:
            raise ValueError(f"commit at position {position} does not follow {self.committed}")
        self.pending.append(self.pending_entry(features, next_ids))
        self.last_features = features[:, -1:]
        self.committed += features.shape[1]
        self.block = None

    def pending_entry(self, features, next_ids):
        """What a commit leaves for the next forward: the features (a block's context rows do not
        read their next tokens)."""
        return features

    def _depth_logits_steps(self, root: int, position: int):
        """Yield the ``BlockForward`` for ``root`` at ``position`` (nothing if this root's block is known
        already), take its (K - 1, V) logits, return them."""
        if self.block is not None and self.block[:2] == (root, position):
            return self.block[2]
        if position != self.committed:
            raise ValueError(
                f"a block at position {position} needs the features up to it; {self.committed} committed"
            )
        # (1, n, F); n = 0 for another root at the position of the last block (its rows are cached)
        features = torch.cat(self.pending, dim=1) if self.pending else self.last_features[:, :0]
        logits = yield BlockForward(self.head, self.cache, features, position, root)  # (K - 1, V)
        self.pending = []
        self.block = (root, position, logits)
        return logits
