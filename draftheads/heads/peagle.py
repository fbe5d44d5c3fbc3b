"""P-EAGLE (arXiv 2602.01469): an EAGLE-3 drafter that drafts every depth of a chain in one forward.

The head is EAGLE-3's (``draftheads.heads.eagle3``: fused features, one midlayer, a reduced draft
vocabulary), and depth 1 is drafted as EAGLE-3 drafts it: the row of the last accepted position
consumes its features and the root token. Depths d >= 2 are *mask rows* at positions
root + d - 2: each consumes a learned feature vector ``mask_hidden`` (in place of the base's
features, through the same ``fc``) and the embedding of ``mask_token_id``, and attends causally to
the prefix, the depth-1 row and the mask rows before it. No drafted token enters a mask row, so all
depths come out of the one forward: a drafting step costs one drafter pass over the new rows plus
D - 1 mask rows, against EAGLE-3's one pass per depth.

Training is EAGLE-3's training-time test with the inputs of steps j >= 1 replaced by the mask row's
(``later_step_inputs``): step j of row i sits at position i + j and sees the step-0 rows up to i and
its own rows of steps 1..j, exactly the keys mask row j sees at inference. (The paper subsamples the
rows of deep steps, its COD sampling, to train many depths cheaply; at the few depths a CPU drafts,
every row is unrolled.)

Checkpoint names: EAGLE-3's and ``mask_hidden`` (1, F h). ``mask_token_id`` is a base-vocabulary
id whose (frozen) embedding marks a mask row: by default the last id, as for DFlash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache

from draftheads.heads.base import register_head
from draftheads.heads.dflash import resolve_mask_token_id
from draftheads.heads.eagle3 import Eagle3Config, Eagle3Head
from draftheads.heads.layers import prefix_causal_mask


@dataclass
class PEagleConfig(Eagle3Config):
    kind: ClassVar[str] = "peagle"
    # Depths drafted in one forward, and the training-time-test steps that train them (EAGLE-3's
    # ttt_steps, here fixing the draft depth too).
    ttt_steps: int = 3
    # Base-vocabulary id whose embedding marks a mask row. None: vocab_size - 1.
    mask_token_id: int | None = None


@register_head
class PEagleHead(Eagle3Head):
    kind = "peagle"
    config_class = PEagleConfig
    drafting = "causal-block"

    def __init__(self, config: PEagleConfig, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        self.mask_token_id = resolve_mask_token_id(config.mask_token_id, base_config.vocab_size)
        # Unit-scale, so hidden_norm(fc(.)) starts away from zero, where RMSNorm's gradient blows up.
        self.mask_hidden = nn.Parameter(torch.randn(1, len(self.feature_layers) * base_config.hidden_size))

    @property
    def num_draft_steps(self) -> int:
        return self.config.ttt_steps

    def mask_rows(self, batch: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, count, h) mask-row states and (B, count) mask token ids."""
        state = self.fuse(self.mask_hidden[None])  # (1, 1, h)
        tokens = torch.full((batch, count), self.mask_token_id, dtype=torch.long, device=state.device)
        return state.expand(batch, count, -1), tokens

    def later_step_inputs(self, hidden, tokens):
        """A mask row's inputs, whatever the previous step drafted or the data holds."""
        state, mask_tokens = self.mask_rows(*tokens.shape)
        return state.to(hidden.dtype), mask_tokens

    def draft_chain(
        self, cache: DynamicCache, features: torch.Tensor, next_ids: torch.Tensor, position: int, depths: int
    ) -> torch.Tensor:
        """One drafting forward for the tree at root ``position``.

        Args:
            cache: the drafter rows of positions 0 .. position - n - 1.
            features: (B, n, F h) base features at positions position - n .. position - 1 (n >= 1),
                appended to ``cache``; next_ids: (B, n) the tokens one position later (the last one
                is the root).
            depths: draft depths wanted (1 .. ``num_draft_steps``).
        Returns:
            (B, depths, N) draft-vocabulary logits, row d - 1 for the token at position + d.
        """
        batch, new = next_ids.shape
        past = cache.get_seq_length()
        if new < 1 or past + new != position:
            raise ValueError(
                f"a P-EAGLE forward at position {position} needs the rows up to it: cache holds {past}, "
                f"{new} new (at least 1: the row of the root)"
            )
        if not 1 <= depths <= self.num_draft_steps:
            raise ValueError(f"depths must be in 1..{self.num_draft_steps}, got {depths}")
        mask_state, mask_tokens = self.mask_rows(batch, depths - 1)
        hidden = torch.cat([self.fuse(features), mask_state], dim=1)  # (B, n + D - 1, h), fc's dtype
        tokens = torch.cat([next_ids, mask_tokens], dim=1)
        positions = torch.arange(position - new, position + depths - 1, device=hidden.device)[None].expand(
            batch, -1
        )
        mask = prefix_causal_mask(batch, past, hidden.shape[1], hidden.dtype, hidden.device)
        states = self.step(hidden, tokens, positions, mask, cache)  # (B, n + D - 1, h)
        if depths > 1:
            cache.crop(-(depths - 1))  # mask rows are not context (crop counts from the end)
        return self.logits(states[:, new - 1 :])  # (B, D, N)
