"""The Drafter of causal-block heads (P-EAGLE; arXiv 2602.01469): one head forward per step drafts
every depth of the tree at once.

The forward (``head.draft_chain``) catches the drafter up on the rows accepted since the last step,
the last of which consumes the root and gives depth 1, and runs the mask rows that give the deeper
depths; their distributions fill a static tree as Medusa's K heads do (``ParallelDrafter``). They
depend on the rows committed up to the root, so they are kept until the next commit.

State: the head's drafter cache (the rows of the committed positions before the pending ones), and
the features and next tokens committed since the last forward, which it appends in the same pass.
Cost per step: one drafter forward over (new rows + depth - 1 mask rows), whatever the tree's depth.
"""

from __future__ import annotations

import torch

from draftheads.infer.block import BlockDrafter
from draftheads.infer.draft import ChainForward, register_drafter


@register_drafter("causal-block")
class CausalBlockDrafter(BlockDrafter):
    """``BlockDrafter``'s state and tree filling; ``pending`` holds (features, next_ids) per commit,
    since the forward's new rows consume their next tokens too."""

    def pending_entry(self, features, next_ids):
        return features, next_ids

    def _depth_logits_steps(self, root: int, position: int):
        """Yield the ``ChainForward`` for the tree at ``position`` (nothing if it ran already), take its
        (D, N) logits, return them. The root must be the last committed next token: the forward's
        depth-1 row consumes it."""
        if self.block is not None and self.block[:2] == (root, position):
            return self.block[2]
        if position != self.committed or not self.pending:
            raise ValueError(
                f"a P-EAGLE forward at position {position} needs the rows up to it committed "
                f"({self.committed} committed, {len(self.pending)} pending)"
            )
        features = torch.cat([f for f, _ in self.pending], dim=1)  # (1, n, F)
        next_ids = torch.cat([ids for _, ids in self.pending], dim=1)  # (1, n)
        if int(next_ids[0, -1]) != root:
            raise ValueError(
                f"root {root} at position {position} is not the committed token {int(next_ids[0, -1])}"
            )
        logits = yield ChainForward(
            self.head, self.cache, features, next_ids, position, self.head.num_draft_steps
        )
        self.pending = []
        self.block = (root, position, logits)
        return logits
