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
its own rows of steps 1..j, exactly the keys mask row j sees at inference. The paper's COD sampling,
which runs geometrically fewer chains at deeper steps to train many depths cheaply, is EAGLE-3's
``cod_ratio``; by default every chain runs every step.

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

    def check_chain(self, past: int, new: int, position: int, depths: int) -> None:
        """Raise unless a forward at root ``position`` over ``past`` cached rows and ``new`` new ones
        holds the rows up to the root and asks for depths the head drafts."""
        if new < 1 or past + new != position:
            raise ValueError(
                f"a P-EAGLE forward at position {position} needs the rows up to it: cache holds {past}, "
                f"{new} new (at least 1: the row of the root)"
            )
        if not 1 <= depths <= self.num_draft_steps:
            raise ValueError(f"depths must be in 1..{self.num_draft_steps}, got {depths}")

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
        self.check_chain(past, new, position, depths)
        device = features.device
        positions = torch.arange(position - new, position + depths - 1, device=device)[None].expand(batch, -1)
        mask = prefix_causal_mask(batch, past, new + depths - 1, self.fc.weight.dtype, device)
        logits = self.draft_chains(cache, features, next_ids, positions, mask, depths)
        if depths > 1:
            cache.crop(-(depths - 1))  # mask rows are not context (crop counts from the end)
        return logits

    def draft_chains(
        self,
        cache: DynamicCache,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        depths: int,
    ) -> torch.Tensor:
        """``draft_chain``'s forward for rows of any prefix and new-row counts: the caller lays the
        rows out, each row's last new row (the root's) at index n - 1, and masks what each row sees.

        Args:
            features: (B, n, F h) and next_ids (B, n): the new rows, appended to ``cache`` with the
                D - 1 mask rows after them; position_ids: (B, n + D - 1);
            attention_mask: (B, 1, n + D - 1, past + n + D - 1) additive.
        Returns:
            (B, depths, N) draft-vocabulary logits.
        """
        batch, new = next_ids.shape
        mask_state, mask_tokens = self.mask_rows(batch, depths - 1)
        hidden = torch.cat([self.fuse(features), mask_state], dim=1)  # (B, n + D - 1, h), fc's dtype
        tokens = torch.cat([next_ids, mask_tokens], dim=1)
        states = self.step(hidden, tokens, position_ids, attention_mask, cache)  # (B, n + D - 1, h)
        return self.logits(states[:, new - 1 :])  # (B, D, N)
