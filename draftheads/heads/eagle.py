"""EAGLE-1/2 (Li et al., ICML 2024): autoregression at the feature level.

Drafter row i consumes ``fc(concat(emb(t_{i+1}), f_i))`` (2h -> h, with bias unless ``fc_bias`` is
false; embedding first, as the EAGLE reference ``cnets.py`` concatenates
``(inputs_embeds, hidden_states)``), where f_i is the base model's last, normed hidden state
(``hs[L]``, what enters lm_head) and emb the frozen base embedding, then runs ONE decoder layer of
the base architecture whose first input_layernorm is dropped (EAGLE's design: fc output is already a
mixed feature). Its output f_hat_{i+1} predicts the base feature at i + 1, and
``base_lm_head(f_hat_{i+1})`` the token t_{i+2}. EAGLE-2 differs only in how the draft tree is grown
(``draftheads.infer``), so both share this head.

Checkpoint names: ``fc.{weight,bias}``, ``layer.*`` (the decoder layer without input_layernorm).

Drafting state (see ``DraftHead.catch_up`` / ``draft_step``):
- cache: a ``DynamicCache`` with one layer (slot 0); row i sits at drafter position i, i.e. the
  position of the feature f_i it consumed (one less than the position of the token t_{i+1}).
- hidden: the drafter's predicted feature f_hat (same space as ``hs[L]``), (B, h) or (B, N, h);
  ``base_lm_head(hidden)`` are its logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache

from draftheads.compat import cache_kwargs
from draftheads.heads.base import DraftHead, HeadConfig, register_head
from draftheads.heads.layers import build_decoder_layer, build_rotary_embedding, prefix_causal_mask


@dataclass
class EagleConfig(HeadConfig):
    kind: ClassVar[str] = "eagle"
    # Training: input features get U(-a, a) noise so the drafter tolerates its own imprecise
    # features at inference (EAGLE trains with U(-0.1, 0.1): Li et al. 2024, "EAGLE", sec. 3.3);
    # 0 disables it.
    feature_noise: float = 0.1
    # EAGLE's fc has a bias; vLLM's EagleLlamaForCausalLM loads none (see draftheads.export.eagle), so
    # heads meant for vLLM's ``eagle`` format train with fc_bias: false.
    fc_bias: bool = True

    def __post_init__(self):
        if self.feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0, got {self.feature_noise}")


@register_head
class EagleHead(DraftHead):
    kind = "eagle"
    config_class = EagleConfig
    drafting = "autoregressive"
    batch_catch_up = True

    def __init__(self, config: EagleConfig, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        hidden_size = base_config.hidden_size
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=config.fc_bias)
        self.layer = build_decoder_layer(base_config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()
        self.rotary_emb = build_rotary_embedding(base_config)  # buffers only, not saved

    def predict_features(
        self,
        features: torch.Tensor,
        next_token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Drafter forward: (B, T, h) features f_i and (B, T) tokens t_{i+1} -> (B, T, h) f_hat_{i+1}.

        ``attention_mask`` is additive (B, 1, T, past + T); ``cache`` (if any) is extended in place.
        """
        embeddings = self.embed_tokens(next_token_ids).to(features.dtype)  # (B, T, h)
        hidden = self.fc(torch.cat([embeddings, features], dim=-1))  # (B, T, h)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.layer(
            hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )  # (B, T, h)

    # ---- drafting -----------------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    def catch_up(self, cache, features, next_token_ids, position_ids, attention_mask=None):
        """See ``DraftHead.catch_up``. ``cache`` must hold exactly the accepted rows before
        ``position_ids[:, 0]``: crop rows written by ``draft_step`` first."""
        batch, length, _ = features.shape
        mask = attention_mask
        if mask is None:
            mask = prefix_causal_mask(batch, cache.get_seq_length(), length, features.dtype, features.device)
        predicted = self.predict_features(features, next_token_ids, position_ids, mask, cache)  # (B, T, h)
        hidden = predicted[:, -1]  # (B, h)
        return hidden, self.base_lm_head(hidden)  # (B, h), (B, V)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        """See ``DraftHead.draft_step``. A node at depth d consumes its parent's f_hat and its own
        token; its drafter position is the last catch-up position + d, and it should see the cached
        prefix, its ancestors' rows and itself."""
        predicted = self.predict_features(hidden, token_ids, position_ids, attention_mask, cache)  # (B, N, h)
        return predicted, self.base_lm_head(predicted)  # (B, N, h), (B, N, V)
