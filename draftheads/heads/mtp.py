"""Multi-token prediction modules (DeepSeek-V3, arXiv 2412.19437 section 2.2) on a frozen base.

D sequential modules. Module k (1-based) at position i combines the previous depth's state
h^{k-1}_i (h^0 = the base model's last, normed hidden state ``hs[L]``) with the embedding of the
token k ahead:
    h'_i = eh_proj(concat(enorm(emb(t_{i+k})), hnorm(h^{k-1}_i)))    (2h -> h, no bias)
    h^k_i = layer(h')                                                (a base decoder layer)
    logits predicting t_{i+k+1} = base_lm_head(norm(h^k_i))
Embedding first, as vLLM and SGLang concatenate [enorm(emb); hnorm(h)]. The embedding and output
head are the base model's, shared and frozen. ``norm`` is DeepSeek's ``shared_head.norm``: h^k
is a pre-norm residual stream, and the frozen lm_head expects normed input (it starts as a copy
of the base's final norm).

Checkpoint names: ``modules.{k}.{enorm.weight, hnorm.weight, eh_proj.weight, layer.*,
norm.weight}`` with k 0-based (``modules.0`` is module 1).

Drafting state (see ``catch_up`` / ``draft_step``): each depth is a different module acting at the
SAME position as the root's predecessor, so a draft node sees the prefix and itself only
(the ``module-per-depth`` drafting style of ``draftheads.infer.draft``).
- cache: an ``MtpCache``: a list with one ``DynamicCache`` per module, plus
  the states each module k >= 2 still waits to process (module k at position i needs t_{i+k},
  so it runs k - 1 positions behind module 1).
- hidden: h^d, the output of module d (pre-norm) for the chain ending at a node, (B, h) or (B, N, h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache

from draftheads.compat import cache_kwargs
from draftheads.heads.base import CatchUpStage, DraftHead, HeadConfig, register_head
from draftheads.heads.layers import (
    build_decoder_layer,
    build_rms_norm,
    build_rotary_embedding,
    padded_causal_mask,
    prefix_and_self_mask,
    prefix_causal_mask,
    shift_left,
)


@dataclass
class MtpConfig(HeadConfig):
    kind: ClassVar[str] = "mtp"
    num_modules: int = 3  # D: draft depth; DeepSeek-V3 trains D = 1
    # lambda in DeepSeek-V3's (lambda / D) sum_k CE_k. With a frozen base this is the only loss, so
    # it just scales gradients; 1.0 keeps the loss a plain mean CE (DeepSeek: 0.3 then 0.1, joint).
    loss_weight: float = 1.0

    def __post_init__(self):
        if self.num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {self.num_modules}")
        if self.loss_weight <= 0:
            raise ValueError(f"loss_weight must be > 0, got {self.loss_weight}")


class MtpModule(nn.Module):
    """One MTP depth: normed embedding + normed state -> projection -> decoder layer."""

    def __init__(self, base_config):
        super().__init__()
        hidden_size = base_config.hidden_size
        self.enorm = build_rms_norm(base_config)
        self.hnorm = build_rms_norm(base_config)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = build_decoder_layer(base_config, layer_idx=0)  # slot 0 of this module's own cache
        self.norm = build_rms_norm(base_config)

    def forward(self, hidden, embeddings, position_ids, attention_mask, position_embeddings, cache=None):
        """(B, T, h) h^{k-1} and (B, T, h) emb(t_{i+k}) -> (B, T, h) h^k."""
        projected = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))  # (B, T, h)
        return self.layer(
            projected,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )


class MtpCache(list):
    """Draft state of an MTP head: a list of ``DynamicCache``, one per module (so cache helpers that
    take "a DynamicCache or a list of them", e.g. ``draftheads.infer.cache.crop_to_lengths``, work
    on it unchanged), plus the states modules k >= 2 have not processed yet.

    ``pending_hidden[k]``: (B, P, h) states h^k that module k + 1 (0-based index k) still waits to
    process, at positions ``pending_positions[k]`` (B, P); None when there are none. Index 0 is
    never used (module 1 processes every new position at once).
    """

    def __init__(self, module_caches: list[DynamicCache]):
        super().__init__(module_caches)
        self.pending_hidden: list[torch.Tensor | None] = [None] * len(module_caches)
        self.pending_positions: list[torch.Tensor | None] = [None] * len(module_caches)


@register_head
class MtpHead(DraftHead):
    kind = "mtp"
    config_class = MtpConfig
    drafting = "module-per-depth"
    staged_catch_up = True

    def __init__(self, config: MtpConfig, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        # The checkpoint name is ``modules.{k}`` (export contract), but ``modules`` is also an
        # nn.Module method, which attribute lookup finds first; so the list is registered under
        # that name directly and read through ``module_list``.
        self._modules["modules"] = nn.ModuleList(MtpModule(base_config) for _ in range(config.num_modules))
        self.rotary_emb = build_rotary_embedding(base_config)  # buffers only, not saved

    @property
    def module_list(self) -> nn.ModuleList:
        return self._modules["modules"]

    def init_from_base(self, base_model) -> None:
        """Each module's output norm starts as the base model's final norm."""
        final_norm = base_model.get_decoder().norm.weight
        with torch.no_grad():
            for module in self.module_list:
                module.norm.weight.copy_(final_norm)

    @property
    def num_draft_steps(self) -> int:
        return self.config.num_modules

    def module_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """(..., h) output of module ``index`` (0-based) -> (..., V) through its norm and the base lm_head."""
        return self.base_lm_head(self.module_list[index].norm(hidden))

    def run_module(self, index, hidden, token_ids, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """Module ``index`` (0-based) on (B, T, h) states and (B, T) tokens t_{i+index+1} -> (B, T, h)."""
        embeddings = self.embed_tokens(token_ids).to(hidden.dtype)  # (B, T, h)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        return self.module_list[index](
            hidden, embeddings, position_ids, attention_mask, position_embeddings, cache
        )

    def unroll(
        self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Training forward: every module over a whole batch. Returns h^1..h^D, each (B, T, h); row i
        of h^k predicts t_{i+k+1} (rows with i + k + 1 >= T are padding)."""
        batch, length = input_ids.shape
        mask = padded_causal_mask(
            attention_mask, batch, length, features.dtype, features.device
        )  # (B, 1, T, T)
        positions = torch.arange(length, device=features.device)[None].expand(batch, length)  # (B, T)
        hidden, states = features, []
        for index in range(self.config.num_modules):
            hidden = self.run_module(index, hidden, shift_left(input_ids, index + 1), positions, mask)
            states.append(hidden)
        return states

    # ---- drafting -----------------------------------------------------------------------------

    def new_cache(self) -> MtpCache:
        return MtpCache([DynamicCache() for _ in range(self.config.num_modules)])

    def draft_caches(self, cache: MtpCache) -> tuple[DynamicCache, ...]:
        return tuple(cache)

    def catch_up(self, cache, features, next_token_ids, position_ids):
        """See ``DraftHead.catch_up``. Module k processes every position i whose token t_{i+k} is now
        known (i <= last - (k - 1)), including positions left pending by earlier calls; module 1's
        output at the last position is returned. Positions must continue the cached ones without
        gaps, with the same offsets in every batch row; crop rows written by ``draft_step`` first.
        (Rows whose caches differ catch up together through ``catch_up_stages``.)
        """
        stages = self.catch_up_stages(cache, features, next_token_ids, position_ids)
        try:
            stage = next(stages)
            while True:
                module_cache = cache[stage.cache_index]
                batch, length, _ = stage.hidden.shape
                mask = prefix_causal_mask(
                    batch, module_cache.get_seq_length(), length, stage.hidden.dtype, stage.hidden.device
                )
                stage = stages.send(self.run_stage(stage, module_cache, mask))
        except StopIteration as done:
            state = done.value
        return state, self.catch_up_logits(state)  # (B, h), (B, V)

    def catch_up_stages(self, cache, features, next_token_ids, position_ids):
        """See ``DraftHead.catch_up_stages``: one stage per module with positions ready, module k on
        its own cache (``cache_index`` k - 1); the pending positions are kept in ``cache``."""
        length = features.shape[1]
        first_position = position_ids[:, :1]  # (B, 1)
        hidden, positions = features, position_ids  # module 1 consumes every new position
        module_one_output = None
        for index in range(self.config.num_modules):
            if cache.pending_hidden[index] is not None:
                hidden = torch.cat([cache.pending_hidden[index], hidden], dim=1)  # (B, R, h)
                positions = torch.cat([cache.pending_positions[index], positions], dim=1)  # (B, R)
            # Row at position i needs t_{i+index+1} = next_token_ids[:, i + index - first_position].
            token_index = positions - first_position + index  # (B, R)
            ready = int((token_index[0] < length).sum())  # rows are in position order
            cache.pending_hidden[index] = hidden[:, ready:] if ready < hidden.shape[1] else None
            cache.pending_positions[index] = positions[:, ready:] if ready < hidden.shape[1] else None
            hidden, positions = hidden[:, :ready], positions[:, :ready]
            if ready == 0:
                continue  # nothing for this module yet, hence nothing new for the next one either
            tokens = torch.gather(next_token_ids, 1, token_index[:, :ready])  # (B, ready)
            hidden = yield CatchUpStage(index, hidden, tokens, positions)  # (B, ready, h)
            if index == 0:
                module_one_output = hidden[:, -1]  # (B, h)
        return module_one_output

    def run_stage(self, stage, cache, attention_mask) -> torch.Tensor:
        return self.run_module(
            stage.cache_index, stage.hidden, stage.token_ids, stage.position_ids, attention_mask, cache
        )

    def catch_up_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.module_logits(0, state)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        """See ``DraftHead.draft_step``. Depth d runs module d + 1 on its parent's h^d and the node's
        token; ``position_ids`` should all be the last catch-up position. The mask covers
        ``draft_caches(cache)[depth]`` (its ``past`` differs per module); each node should see that
        cached prefix and itself only; ``attention_mask=None`` builds exactly that mask."""
        if not 1 <= depth < self.config.num_modules:
            raise ValueError(
                f"mtp head with {self.config.num_modules} modules drafts depths "
                f"1..{self.config.num_modules - 1}, got depth {depth}"
            )
        module_cache = cache[depth]
        batch, count, _ = hidden.shape
        past = module_cache.get_seq_length()
        if attention_mask is None:
            attention_mask = prefix_and_self_mask(batch, past, count, hidden.dtype, hidden.device)
        elif attention_mask.shape[-1] != past + count:
            raise ValueError(
                f"mtp draft_step depth {depth}: attention_mask covers {attention_mask.shape[-1]} keys, "
                f"but module {depth + 1}'s cache holds {past} rows + {count} nodes = {past + count}"
            )
        hidden = self.run_module(
            depth, hidden, token_ids, position_ids, attention_mask, module_cache
        )  # (B, N, h)
        return hidden, self.module_logits(depth, hidden)  # (B, N, h), (B, N, V)
