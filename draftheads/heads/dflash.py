"""DFlash (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv
2602.06036): a block of K tokens drafted in one forward, conditioned on fused target features.

The block at root position r holds the root (the base model's own token t_r, the "anchor") and
K - 1 mask tokens at positions r + 1 .. r + K - 1; block row k's output predicts t_{r+k}. Block rows
attend bidirectionally to each other and to the *context*: the target features of positions < r,
fused and normed once, ``c_i = hidden_norm(fc(concat(hs[a]_i, hs[b]_i, ...)))`` for the configured
``feature_layers``. Every draft layer reads the same context as extra keys and values through its
own k/v projections (the context is not carried through the layers), as in the reference drafter
(github.com/z-lab/dflash, ``dflash/model.py``: ``k = cat(k_proj(target_hidden), k_proj(block))``).

The draft layers are the base architecture's own decoder layers (``layers.build_decoder_layer``):
a layer's attention is called on ``concat(context, input_layernorm(block))`` and only the block
rows' outputs are kept (the context rows' queries are computed and thrown away; that is the price
of not forking the attention module). The base embedding (of the root and of ``mask_token_id``) and
lm_head are shared and frozen; ``norm`` comes before lm_head.

Drafting state: one ``DynamicCache`` with a slot per draft layer, holding the context rows' keys and
values for the committed positions; the block's own rows are cropped after every block.

Checkpoint names: ``fc.weight``, ``hidden_norm.weight``, ``layers.{i}.<the base layer's names>``,
``norm.weight`` (the reference's and vLLM's, ``qwen3_dflash.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache

from draftheads.compat import cache_kwargs
from draftheads.heads.base import DraftHead, HeadConfig, register_head
from draftheads.heads.layers import (
    add_attention,
    add_feed_forward,
    additive_mask,
    build_decoder_layer,
    build_rms_norm,
    build_rotary_embedding,
    layout_config,
    norm_weight_for,
)
from draftheads.settings import ConfigError


def resolve_mask_token_id(mask_token_id: int | None, vocab_size: int) -> int:
    """The base-vocabulary id whose embedding marks a mask row: ``head.mask_token_id``, or the last
    id when it is None (an id the heads' data rarely holds)."""
    chosen = vocab_size - 1 if mask_token_id is None else mask_token_id
    if not 0 <= chosen < vocab_size:
        raise ConfigError(f"head.mask_token_id={chosen} is outside the base vocab (size {vocab_size})")
    return chosen


@dataclass
class DFlashConfig(HeadConfig):
    kind: ClassVar[str] = "dflash"
    # Draft decoder layers. The DFlash releases use 5 on 8B targets; one keeps a CPU drafter cheap.
    num_layers: int = 1
    # Whose decoder layer: None, the base architecture's own; "qwen3", Qwen3 layers (q/k norms, a
    # SiLU MLP) with the base's geometry, the layer the DFlash releases, speculators and vLLM build
    # for any target (needed by the engine formats, ``draftheads.export.dflash``).
    layer_architecture: str | None = None
    # Tokens per block, the root included: one forward drafts block_size - 1 depths (paper: 16).
    block_size: int = 16
    # Indices into HF hidden_states (0 = embedding output). None: ``default_feature_layers``.
    feature_layers: tuple[int, ...] | None = None
    # The token whose (frozen) base embedding fills the masked block rows. None: the last id of the
    # base vocabulary. The reference adds a special token; any fixed id serves, since only rows
    # 1.. of a block ever hold it and the drafter learns what it means there.
    mask_token_id: int | None = None
    # Training: blocks scored per sequence (SpecForge ``num_anchors``: 512), anchors drawn at random
    # among the positions whose next token is supervised.
    anchors_per_sequence: int = 512
    # Training: block row k's loss is weighted exp(-(k - 1) / loss_decay) (paper sec. 4: 7 for
    # blocks of 16, 5 for 10, 4 for 8); an early row's miss ends the accepted chain, so it counts
    # more. None: equal weights.
    loss_decay: float | None = 7.0
    # Training targets: "data", the paper's (cross-entropy on the data's tokens, which on
    # self-distilled data are the base's own); "base", the base model's greedy token at each
    # position given the true prefix (what greedy verification accepts, for data the base did not
    # write; one extra lm_head projection per scored token).
    targets: str = "data"

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.layer_architecture not in (None, "qwen3"):
            raise ValueError(f"layer_architecture must be null or 'qwen3', got {self.layer_architecture!r}")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (the root and one drafted token), got {self.block_size}"
            )
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            if not layers or any(index < 0 for index in layers) or len(set(layers)) != len(layers):
                raise ValueError(f"feature_layers must be distinct non-negative indices, got {layers}")
            self.feature_layers = layers
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.anchors_per_sequence < 1:
            raise ValueError(f"anchors_per_sequence must be >= 1, got {self.anchors_per_sequence}")
        if self.targets not in ("data", "base"):
            raise ValueError(f"targets must be 'data' or 'base', got {self.targets!r}")
        if self.loss_decay is not None and self.loss_decay <= 0:
            raise ValueError(f"loss_decay must be > 0 (or null for equal weights), got {self.loss_decay}")


def default_feature_layers(num_hidden_layers: int, num_layers: int) -> tuple[int, ...]:
    """One base layer per draft layer (at least 3, as EAGLE-3 fuses), spread evenly from the output
    of decoder layer 1 to that of layer L - 3, as the DFlash releases choose them (Qwen3-8B, 5 draft
    layers: outputs of layers 1, 9, 17, 25, 33 of 36), as HF ``hidden_states`` indices (output of
    layer i = index i + 1)."""
    count, first, last = max(num_layers, 3), 1, num_hidden_layers - 3
    return tuple(round(first + step * (last - first) / (count - 1)) + 1 for step in range(count))


def resolve_feature_layers(config: DFlashConfig, num_hidden_layers: int) -> tuple[int, ...]:
    """The configured (or default) feature layers, checked against the base depth L."""
    explicit = config.feature_layers is not None
    layers = config.feature_layers or default_feature_layers(num_hidden_layers, config.num_layers)
    hint = "" if explicit else f" (the default for a {num_hidden_layers}-layer base); set head.feature_layers"
    for index in layers:
        if not 0 <= index <= num_hidden_layers:
            raise ConfigError(
                f"head.feature_layers={list(layers)}: index {index} is outside the base model's "
                f"hidden_states (valid 0..{num_hidden_layers}){hint}"
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"head.feature_layers={list(layers)}: duplicate index{hint}")
    return tuple(layers)


def layer_config(base_config, layer_architecture: str | None):
    """The config the draft layers are built from: the base's, or a Qwen3 config of its geometry."""
    if layer_architecture is None or layer_architecture == base_config.model_type:
        return base_config
    return layout_config(base_config, layer_architecture)


def block_position_weights(block_size: int, decay: float | None) -> list[float]:
    """The loss weights of block rows 1..K-1: exp(-(k - 1) / decay), or ones (host floats)."""
    return [1.0 if decay is None else math.exp(-row / decay) for row in range(block_size - 1)]


def choose_anchors(
    candidates: torch.Tensor, count: int, priority: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` anchor positions per row among ``candidates`` (B, T) bool, ascending.

    ``priority`` (B, T) values in [0, 1): the candidates of lowest priority (ties: the earlier
    position), so i.i.d. uniform priorities make a uniform draw without replacement that depends
    on nothing but each row's own priorities; None: evenly spaced (evaluation is deterministic).
    Returns (anchors, valid), each (B, N); N = the most any row gets (at least 1); slots past a
    row's share are position 0 and not valid.
    """
    length = candidates.shape[1]
    available = candidates.sum(dim=1)  # (B,)
    width = max(int(available.clamp(max=count).max()), 1) if candidates.numel() else 1
    share = available.clamp(max=count)[:, None]  # (B, 1) anchors this row gets
    if priority is None:
        # Of n candidates (rank r), take the first of each run with equal floor(r * share / n).
        rank = candidates.cumsum(dim=1) - 1  # (B, T)
        total = available.clamp(min=1)[:, None]
        first = (rank <= 0) | (rank * share // total != (rank - 1) * share // total)
        priority = (~first).float()
    priority = priority.masked_fill(~candidates, 2.0)
    picked = priority.argsort(dim=1, stable=True)[:, :width]  # (B, N)
    valid = torch.arange(width, device=candidates.device)[None] < share
    anchors = torch.where(valid, picked, torch.zeros_like(picked))
    # Ascending anchors, invalid slots last.
    order = torch.where(valid, anchors, torch.full_like(anchors, length)).argsort(dim=1, stable=True)
    return anchors.gather(1, order), valid.gather(1, order)


def training_block_mask(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    attention_mask: torch.Tensor | None,
    length: int,
    block_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(B, 1, T + N K, T + N K) additive mask over [context rows | N blocks of K rows].

    A block row sees the context strictly before its anchor (the features at the anchor itself come
    from the same forward that verifies the block, so inference never has them) and its own block,
    both ways. A context row sees only itself: its output is never read.
    """
    batch, blocks = anchors.shape
    device = anchors.device
    positions = torch.arange(length, device=device)
    before_anchor = positions[None, None, :] < anchors[:, :, None]  # (B, N, T)
    before_anchor = before_anchor & valid[:, :, None]
    if attention_mask is not None:
        before_anchor = before_anchor & attention_mask.bool()[:, None, :]
    block_index = torch.arange(blocks * block_size, device=device) // block_size
    same_block = block_index[:, None] == block_index[None, :]  # (N K, N K)
    context_rows = torch.cat(
        [
            torch.eye(length, dtype=torch.bool, device=device),
            torch.zeros(length, blocks * block_size, dtype=torch.bool, device=device),
        ],
        dim=1,
    )[None].expand(batch, -1, -1)  # (B, T, T + N K)
    block_rows = torch.cat(
        [
            before_anchor.repeat_interleave(block_size, dim=1),  # (B, N K, T)
            same_block[None].expand(batch, -1, -1),
        ],
        dim=2,
    )  # (B, N K, T + N K)
    return additive_mask(torch.cat([context_rows, block_rows], dim=1)[:, None], dtype)


@register_head
class DFlashHead(DraftHead):
    kind = "dflash"
    engine_layout = "qwen3"  # vLLM, SGLang, speculators and llama.cpp build its drafter so
    config_class = DFlashConfig
    drafting = "block"

    def __init__(self, config: DFlashConfig, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        hidden_size, vocab_size = base_config.hidden_size, base_config.vocab_size
        self._feature_layers = resolve_feature_layers(config, base_config.num_hidden_layers)
        self.mask_token_id = resolve_mask_token_id(config.mask_token_id, vocab_size)
        self.fc = nn.Linear(len(self._feature_layers) * hidden_size, hidden_size, bias=False)
        self.layer_config = layer_config(base_config, config.layer_architecture)
        self.hidden_norm = build_rms_norm(self.layer_config)
        self.layers = nn.ModuleList(
            build_decoder_layer(self.layer_config, layer_idx=i) for i in range(config.num_layers)
        )
        self.norm = build_rms_norm(self.layer_config)
        self.rotary_emb = build_rotary_embedding(self.layer_config)  # buffers only, not saved

    def init_from_base(self, base_model) -> None:
        """Start ``norm`` at the base's final norm, the scale the shared lm_head reads its input
        at. Every DFlash head here starts from it; it is not shown to beat a unit norm (on SmolLM2
        an untrained head's loss starts higher with it), only to train (docs/training.md, "DFlash")."""
        final_norm = getattr(base_model.base_model, "norm", None)
        if final_norm is not None and final_norm.weight.shape == self.norm.weight.shape:
            with torch.no_grad():
                base_type, layer_type = base_model.config.model_type, self.layer_config.model_type
                self.norm.weight.copy_(norm_weight_for(final_norm.weight, base_type, layer_type))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_draft_steps(self) -> int:
        return self.config.block_size - 1

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._feature_layers

    def select_features(self, hidden_states) -> torch.Tensor:
        """(B, T, F h): the ``feature_layers`` entries of ``hidden_states``, concatenated in order."""
        return torch.cat([hidden_states[index] for index in self._feature_layers], dim=-1)

    # ---- the drafter --------------------------------------------------------------------------

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, F h) target features -> (B, T, h) context rows."""
        return self.hidden_norm(self.fc(features))

    def block_embeddings(self, roots: torch.Tensor, blocks: int) -> torch.Tensor:
        """(B, N) root ids -> (B, N K, h): per block, the root's embedding then K - 1 mask embeddings."""
        batch = roots.shape[0]
        ids = torch.full(
            (batch, blocks, self.block_size), self.mask_token_id, dtype=torch.long, device=roots.device
        )
        ids[:, :, 0] = roots
        return self.embed_tokens(ids.view(batch, -1))

    def denoise(
        self,
        context: torch.Tensor,
        block: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """The draft layers over block rows that read context rows as extra keys and values.

        Args:
            context: (B, C, h) new context rows (their keys/values are appended to ``cache``).
            block: (B, Q, h) block embeddings.
            position_ids: (B, C + Q) positions of the context rows, then of the block rows.
            attention_mask: (B, 1, C + Q, past + C + Q) additive.
        Returns:
            (B, Q, h) normed block states (lm_head input).
        """
        hidden = block.to(context.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        width = context.shape[1]
        model_type = self.layer_config.model_type
        for layer in self.layers:
            attention_input = torch.cat([context, layer.input_layernorm(hidden)], dim=1)  # (B, C + Q, h)
            attended, _ = layer.self_attn(
                hidden_states=attention_input,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_kwargs(cache),
                position_embeddings=position_embeddings,
            )  # (B, C + Q, h)
            hidden = add_attention(layer, model_type, hidden, attended[:, width:])
            hidden = add_feed_forward(layer, model_type, hidden)  # (B, Q, h)
        return self.norm(hidden)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """(..., h) normed block states -> (..., V) base-vocabulary logits."""
        return self.base_lm_head(states)

    def training_blocks(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        anchors: torch.Tensor,
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """All blocks of a training batch in one forward: (B, T, F h) features, (B, T) ids, (B, N)
        anchors (``choose_anchors``) -> (B, N, K, h) normed states; row k of block n predicts
        ``input_ids[:, anchors[:, n] + k]``."""
        batch, length = input_ids.shape
        blocks, device = anchors.shape[1], input_ids.device
        context = self.context(features)  # (B, T, h)
        block = self.block_embeddings(input_ids.gather(1, anchors), blocks)  # (B, N K, h)
        offsets = torch.arange(self.block_size, device=device)
        block_positions = (anchors[:, :, None] + offsets).view(batch, -1)  # (B, N K)
        positions = torch.cat(
            [torch.arange(length, device=device)[None].expand(batch, -1), block_positions], 1
        )
        mask = training_block_mask(anchors, valid, attention_mask, length, self.block_size, context.dtype)
        states = self.denoise(context, block, positions, mask)  # (B, N K, h)
        return states.view(batch, blocks, self.block_size, -1)

    # ---- drafting -----------------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    def draft_block(
        self, cache: DynamicCache, features: torch.Tensor, position: int, root: torch.Tensor
    ) -> torch.Tensor:
        """One block at root position ``position``.

        Args:
            cache: the context rows of positions 0 .. position - n - 1 (from earlier calls).
            features: (B, n, F h) target features at positions position - n .. position - 1, not yet
                in ``cache``; they are added to it (n may be 0).
            root: (B,) the base model's token at ``position``.
        Returns:
            (B, K - 1, V) logits for positions position + 1 .. position + K - 1.
        """
        batch, new = features.shape[0], features.shape[1]
        device, past = features.device, cache.get_seq_length()
        if past + new != position:
            raise ValueError(
                f"draft cache holds {past} + {new} context rows, but the block starts at {position}"
            )
        positions = torch.arange(position - new, position + self.block_size, device=device)[None].expand(
            batch, -1
        )
        rows = torch.arange(new + self.block_size, device=device)
        keys = torch.arange(past + new + self.block_size, device=device)
        # Context rows: the prefix and themselves causally (outputs unused); block rows: everything.
        allowed = (keys[None, :] <= rows[:, None] + past) | (rows[:, None] >= new)
        mask = additive_mask(allowed, features.dtype)[None, None].expand(batch, 1, -1, -1)
        return self.draft_blocks(cache, features, root, positions, mask)

    def draft_blocks(
        self,
        cache: DynamicCache,
        features: torch.Tensor,
        root: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """``draft_block`` with the positions and mask given, for rows whose prefixes differ in
        length (batched drafting, ``draftheads.infer.batch_draft``: each row's cache entries, new
        context rows and block rows laid out, and masked, by the caller).

        Args:
            features: (B, n, F h) new context rows' features (appended to ``cache``).
            root: (B,) each row's root token.
            position_ids: (B, n + K) positions of the new context rows, then of the block rows.
            attention_mask: (B, 1, n + K, past + n + K) additive.
        Returns:
            (B, K - 1, V) logits, row by row.
        """
        context = self.context(features)  # (B, n, h)
        block = self.block_embeddings(root[:, None], 1)  # (B, K, h)
        mask = attention_mask.to(context.dtype)
        states = self.denoise(context, block, position_ids, mask, cache)  # (B, K, h)
        cache.crop(-self.block_size)  # the block's own rows are not context (crop counts from the end)
        return self.logits(states[:, 1:])  # (B, K - 1, V)
