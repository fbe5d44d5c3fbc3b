"""EAGLE-3 (arXiv 2503.01840): fused multi-layer features, a reduced draft vocabulary, and
training-time test.

Drafter row i consumes g_i = fc(concat(hs[a]_i, hs[b]_i, hs[c]_i)) (3h -> h, no bias) for the
configured ``feature_layers`` (a, b, c) of the HF ``hidden_states`` tuple, and the token t_{i+1}.
The draft layer ("midlayer") is the base architecture's decoder layer (or, with
``layer_architecture: llama``, a Llama layer of the base's geometry, the layout the engines build)
with two changes, as in the EAGLE-3 reference (``traineagle3/cnets.py``, ``LlamaDecoderLayeremb``)
and the SGLang/SafeAILab checkpoint format:
- attention reads ``concat(input_layernorm(emb(t_{i+1})), hidden_norm(g_i))`` (embedding first),
  so q/k/v take 2h inputs: the base layer is built as is and its q/k/v projections are replaced by
  2h-input ones (a config with hidden_size 2h would also widen o_proj and the MLP, which is wrong);
- the residual around attention is g_i (h wide), then the usual post-attention norm + MLP.
Its output (before the final ``norm``; after it with EAGLE-3.1's ``norm_output``) is the drafter
state; ``lm_head(norm(state))`` (``lm_head(state)`` with ``norm_output``) gives logits over the
draft vocabulary (N ids); ``d2t`` maps a draft id d to the target id d + d2t[d], and ``t2d`` marks
the target ids in the draft vocabulary.

Checkpoint names (match SGLang/SafeAILab): ``fc.weight``, ``midlayer.{self_attn.{q,k,v,o}_proj,
mlp.{gate,up,down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
``norm.weight``, ``lm_head.weight``, buffers ``d2t`` (int64, N) and ``t2d`` (bool, V); with
``num_layers`` > 1 (not an engine layout), the plain decoder layers after the midlayer as ``layers.{i}.``.

Drafting state (see ``DraftHead.catch_up`` / ``draft_step``):
- features: (B, T, 3h) the concatenated ``feature_layers`` (``select_features``), before ``fc``.
- cache: a ``DynamicCache`` with a slot per draft layer (slot 0 the midlayer); row i sits at
  drafter position i (the position of the features it consumed).
- hidden: the last draft layer's output (pre-``norm``), (B, h) or (B, N, h); a draft step feeds it
  back in place of g (training-time test does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from draftheads.compat import cache_kwargs
from draftheads.heads.base import GROWABLE, INIT_ONLY, TRAINING_ONLY, DraftHead, HeadConfig, register_head
from draftheads.heads.layers import (
    add_attention,
    add_feed_forward,
    build_decoder_layer,
    build_rms_norm,
    build_rotary_embedding,
    layout_config,
    padded_causal_mask,
    prefix_causal_mask,
    replace_linear_input,
    shift_left,
)
from draftheads.heads.ttt_attention import StepKeys, StepMask
from draftheads.settings import ConfigError

# Default draft vocabulary cap: the EAGLE-3 release and SpecForge use 32,000 ids for Llama-3's
# 128,256. Token frequencies are Zipfian, so the number of ids needed to cover nearly all
# assistant text barely grows with the tokenizer's size; a base vocab at or under the cap is used
# whole. SmolLM2 (49,152) gets 32,000, cutting the vocab projection (the drafter's largest matmul)
# by 35%; CPU configs may go lower.
DEFAULT_DRAFT_VOCAB_CAP = 32000
# Ridge of ``grow_draft_vocabulary``'s fit, as a fraction of the mean eigenvalue of the base rows'
# Gram matrix. On SmolLM2's 8,192-id heads, fitted on three quarters of the ids and scored on the
# rest, 0.1 explained the most variance (R^2 0.28; 0.27 unregularised, 0.24 at 1.0).
GROWTH_RIDGE = 0.1
EAGLE3_LAYOUTS = (None, "llama")  # head.layer_architecture
# head.objective: the names of draftheads.train.losses.EAGLE3_STEP_LOSSES (heads never import train)
EAGLE3_OBJECTIVES = ("soft_ce", "log_acceptance", "kl_acceptance", "hass")


@dataclass
class Eagle3Config(HeadConfig):
    kind: ClassVar[str] = "eagle3"
    # Indices into HF hidden_states (0 = embedding output). None: the EAGLE-3 choice (2, L//2, L-3).
    feature_layers: tuple[int, ...] | None = None
    # Draft vocabulary size N. None: min(V, DEFAULT_DRAFT_VOCAB_CAP). A run continuing a saved
    # head with a smaller vocabulary grows it (``load_saved``, ``grow_draft_vocabulary``).
    draft_vocab_size: int | None = field(default=None, metadata={GROWABLE: True})
    # Unrolled steps of training-time test: the EAGLE-3 training code (and SpecForge) use 7, the
    # paper 5; 7 matches the draft depth EAGLE-2 trees use (SafeAILab/EAGLE eagle/model/ea_model.py,
    # ``EaModel.from_pretrained(depth=7)``). Training-only: drafting runs as deep as its tree, so a
    # continued run may unroll more or fewer steps than the saved head trained with.
    ttt_steps: int = field(default=7, metadata={TRAINING_ONLY: True})
    # COD sampling (P-EAGLE, arXiv 2602.01469): TTT step j >= 1 runs a scored chain with
    # probability max(cod_ratio^j, cod_ratio_min), nested (a chain that stops runs no later step),
    # so deep steps cost fewer rows and carry fewer loss terms. 1.0: every scored chain runs every
    # step. The P-EAGLE reference samples with 0.7 and a floor of 0.2. Evaluation runs every step.
    cod_ratio: float = field(default=1.0, metadata={TRAINING_ONLY: True})
    cod_ratio_min: float = field(default=0.2, metadata={TRAINING_ONLY: True})
    # Width of the draft layer's MLP. None: the base's ``intermediate_size``. A wider MLP gives
    # the one draft layer more capacity; the engine formats carry it in the draft layer's
    # config.json. A run continuing a narrower saved head grows it (``load_saved``). Measured in
    # docs/training.md, "Settings that matter".
    intermediate_size: int | None = field(default=None, metadata={GROWABLE: True})
    # Start from the base model's weights where they fit, not from random ones: the draft layer
    # from the base's last decoder layer (q/k/v read its weights on the g half of their input and
    # start at zero on the embedding half; hidden_norm is that layer's input norm), the final norm
    # from the base's, and lm_head from the base lm_head's rows of the draft vocabulary. ``fc``
    # stays random. Measured against random initialisation in docs/training.md, "Settings that matter".
    init_from_base: bool = field(default=False, metadata={INIT_ONLY: True})
    # Training loss per TTT step: (1 - w) x the soft cross-entropy against the base model's
    # distribution over the draft vocabulary (the EAGLE-3 reference's target) + w x the
    # cross-entropy on the base model's argmax, the one token greedy verification accepts.
    # Measured in docs/training.md, "Settings that matter".
    hard_target_weight: float = field(default=0.0, metadata={TRAINING_ONLY: True})
    # The loss of a TTT step against the base's distribution p over the draft vocabulary, q the
    # draft's (draftheads.train.losses): soft_ce, the EAGLE-3 reference's cross-entropy (with
    # hard_target_weight); log_acceptance, -log alpha with alpha = sum min(p, q), the acceptance
    # rate of speculative sampling; kl_acceptance, KL while alpha is low, 1 - alpha as it rises
    # (the LK losses, arXiv 2602.23881); hass, soft_ce plus the cross-entropy on the base's top-K
    # tokens (HASS, arXiv 2408.15766; K and weight in draftheads.train.losses).
    objective: str = field(default="soft_ce", metadata={TRAINING_ONLY: True})
    # Draft decoder layers. The first is EAGLE-3's midlayer (attention over [embedding | g]); each
    # further one is a plain base-architecture decoder layer over the state, with its own slot in
    # the draft cache. The EAGLE-3 release and the engine formats have one; more costs a drafting
    # forward per layer. A run continuing a saved head with fewer layers grows it (``load_saved``).
    # Measured in docs/training.md, "Settings that matter".
    num_layers: int = field(default=1, metadata={GROWABLE: True})
    # Whose decoder layer the draft layers are: None, the base architecture's own; "llama", a Llama
    # layer of the base's geometry with a SiLU MLP, the one layout the engines' EAGLE-3 drafters
    # have whatever the target (vLLM llama_eagle3.py, llama.cpp src/models/eagle3.cpp; both MLPs are
    # SiLU only). The engine formats need it on a base that is not a Llama (Gemma 3). The head embeds
    # through the base's module (Gemma: rows x sqrt(hidden_size)), the engines take the raw rows of
    # the target's table; input_layernorm makes the two agree up to its epsilon.
    layer_architecture: str | None = None
    # EAGLE-3.1's two changes (arXiv 2605.09992; vLLM and speculators call the fields fc_norm and
    # norm_output). fc_norm: an RMSNorm on each captured base layer's state
    # before fc, so every layer enters the fusion at one scale whatever its raw magnitude.
    # norm_output: a draft step hands on the final norm's output (lm_head reads it as is), so the
    # state fed back at depth d + 1 has the scale of the one lm_head was trained on.
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            if not layers or any(index < 0 for index in layers) or len(set(layers)) != len(layers):
                raise ValueError(f"feature_layers must be distinct non-negative indices, got {layers}")
            self.feature_layers = layers
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if not 0.0 < self.cod_ratio <= 1.0:
            raise ValueError(f"cod_ratio must be in (0, 1], got {self.cod_ratio}")
        if not 0.0 <= self.cod_ratio_min <= 1.0:
            raise ValueError(f"cod_ratio_min must be in [0, 1], got {self.cod_ratio_min}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if not 0.0 <= self.hard_target_weight <= 1.0:
            raise ValueError(f"hard_target_weight must be in [0, 1], got {self.hard_target_weight}")
        if self.objective not in EAGLE3_OBJECTIVES:
            raise ValueError(f"objective must be one of {EAGLE3_OBJECTIVES}, got {self.objective!r}")
        if self.hard_target_weight and self.objective != "soft_ce":
            raise ValueError(
                f"hard_target_weight ({self.hard_target_weight}) applies to the soft_ce objective, "
                f"not {self.objective!r}"
            )
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.layer_architecture not in EAGLE3_LAYOUTS:
            raise ValueError(
                f"layer_architecture must be null or one of {EAGLE3_LAYOUTS[1:]}, "
                f"got {self.layer_architecture!r}"
            )


def draft_layer_base(base_config, layer_architecture: str | None):
    """The config the draft layers are built from: the base's, or a Llama one of its geometry."""
    if layer_architecture is None or layer_architecture == base_config.model_type:
        return base_config
    return layout_config(base_config, layer_architecture)


def default_feature_layers(num_hidden_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/middle/high layers as HF ``hidden_states`` indices: (2, L//2, L-3)."""
    return (2, num_hidden_layers // 2, num_hidden_layers - 3)


def resolve_feature_layers(config: Eagle3Config, num_hidden_layers: int) -> tuple[int, ...]:
    """The configured (or default) feature layers, checked against the base depth L."""
    layers = config.feature_layers or default_feature_layers(num_hidden_layers)
    explicit = config.feature_layers is not None
    for index in layers:
        if not 0 <= index <= num_hidden_layers:
            raise ConfigError(
                f"head.feature_layers={list(layers)}: index {index} is outside the base model's "
                f"hidden_states (valid 0..{num_hidden_layers} for num_hidden_layers={num_hidden_layers})"
                + ("" if explicit else "; set head.feature_layers explicitly")
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(
            f"head.feature_layers={list(layers)}: duplicate index"
            + (
                ""
                if explicit
                else f" (the default for a {num_hidden_layers}-layer base); "
                "set head.feature_layers explicitly"
            )
        )
    return tuple(layers)


def resolve_draft_vocab_size(config: Eagle3Config, vocab_size: int) -> int:
    size = config.draft_vocab_size or min(vocab_size, DEFAULT_DRAFT_VOCAB_CAP)
    if size > vocab_size:
        raise ConfigError(f"head.draft_vocab_size={size} exceeds the base vocab_size={vocab_size}")
    return size


def by_frequency(token_counts: torch.Tensor) -> torch.Tensor:
    """(V,) target ids, most frequent first (ties: lower id first): the order draft vocabularies
    take ids in."""
    return torch.argsort(token_counts.detach().cpu().double(), descending=True, stable=True)


def vocabulary_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the ascending target ids ``draft_ids`` (N,): d2t[d] = draft_ids[d] - d, and
    t2d the (V,) mask of the ids in the vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids] = True
    return draft_ids - torch.arange(len(draft_ids), device=draft_ids.device), t2d


def grow_draft_vocabulary(
    saved_ids: torch.Tensor,
    saved_rows: torch.Tensor,
    base_rows: torch.Tensor,
    token_counts: torch.Tensor,
    size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocabulary of ``size`` ids grown from a trained one: (ids, lm_head rows).

    saved_ids: (N_s,) the trained head's target ids, ascending; saved_rows: (N_s, h) its lm_head;
    base_rows: (V, h) the base lm_head; token_counts: (V,) this run's supervised-token counts.
    Every saved id keeps its row, so the logits of the ids the head already drafts do not change;
    the ids added are the most frequent ones not yet in it (ties: lower id first, as
    ``init_from_data``). A new id's row is its base lm_head row through the linear map that takes
    the base's rows of the saved ids to the head's own (a ridge least-squares fit, so that a
    vocabulary not much larger than h cannot blow the map up): the best linear guess of where the
    head would have put it. Ids come back ascending (``d2t`` stays non-decreasing)."""
    saved_size = saved_rows.shape[0]
    vocab_size = base_rows.shape[0]
    if token_counts.shape != (vocab_size,):
        raise ValueError(f"token_counts must have shape ({vocab_size},), got {tuple(token_counts.shape)}")
    if not saved_size <= size <= vocab_size:
        raise ValueError(f"cannot grow a {saved_size}-id draft vocabulary to {size} ids of {vocab_size}")
    device = saved_ids.device
    _, in_saved = vocabulary_maps(saved_ids, vocab_size)
    order = by_frequency(token_counts).to(device)
    added = order[~in_saved[order]][: size - saved_size]  # (size - N_s,)
    # (h, h) map: base row -> head row, a ridge fit on the saved ids, in float64
    base = base_rows.detach().to(device=device, dtype=torch.float64)
    inputs, targets = base[saved_ids], saved_rows.detach().to(torch.float64)
    gram = inputs.T @ inputs
    ridge = GROWTH_RIDGE * torch.trace(gram) / gram.shape[0]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=device)
    linear_map = torch.linalg.solve(gram + ridge * eye, inputs.T @ targets)
    ids, order_of = torch.sort(torch.cat([saved_ids, added]))
    rows = torch.cat([saved_rows.detach().to(torch.float64), base[added] @ linear_map])[order_of]
    return ids, rows.to(saved_rows.dtype)  # (size,), (size, h)


@dataclass(frozen=True)
class ChainSlots:
    """Which drafter rows the steps after step 0 of the training-time test run on, laid out so that
    each step's rows are a prefix of every batch row's slots: ``index`` (B, R) long, the drafter
    row i of each slot (longest chain first, in order among equal chains; the unused slots of a
    short batch row are row 0); ``chain_steps`` (B, R) long, the steps each slot's chain runs (0:
    unused); ``widths`` (ttt_steps,) host ints, the slots step j runs on (the most chains of any
    batch row reaching it, at least 1 so a step's states keep their shape).

    Built from (B, T) host masks before a batch moves to the device (``of``), the unroll reads no
    value on the host: ``widths`` are plain ints.
    """

    index: torch.Tensor
    chain_steps: torch.Tensor
    widths: tuple[int, ...]

    @classmethod
    def of(cls, rows: torch.Tensor, steps: int) -> ChainSlots:
        """``rows`` (B, T): bool, True for every step of a row's chain; long, the number of steps
        row i's chain runs (0: none; COD sampling ends chains early)."""
        chain_steps = rows.long() * steps if rows.dtype == torch.bool else rows.long().clamp(0, steps)
        index, slot_steps = gather_rows(chain_steps)
        return cls(index, slot_steps, tuple(step_widths(slot_steps, steps)))

    @classmethod
    def every_row(cls, batch: int, length: int, steps: int, device=None) -> ChainSlots:
        """Every row, every step (rows with i + j + 2 >= T are then padding)."""
        index = torch.arange(length, device=device)[None].expand(batch, length)
        return cls(index, torch.full_like(index, steps), (length,) * steps)

    def at_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, scored), each (B, R_step): the rows of step ``step``'s states and whether a
        slot's chain reaches that step."""
        width = self.widths[step]
        return self.index[:, :width], self.chain_steps[:, :width] > step


@dataclass
class UnrolledRows:
    """What ``training_time_test`` returns: per step j a (B, R_j, h) state at the drafter rows
    ``chains.index[:, :R_j]``. R_0 = R; R_j is smaller when some chains stop before step j (COD
    sampling), since slots are ordered longest chain first."""

    states: list[torch.Tensor]  # ttt_steps x (B, R_j, h)
    chains: ChainSlots

    def at_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index, scored), each (B, R_step): see ``ChainSlots.at_step``."""
        return self.chains.at_step(step)


def gather_rows(chain_steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) long steps per row (0: not picked) -> (index, slot_steps), each (B, R) with R = the
    most rows any batch row picks: the picked rows, longest chain first and in order among equal
    chains; the rest are row 0 with 0 steps. A step's rows are then a prefix of every batch row's
    slots, so each later step runs on the first slots alone."""
    width = max(int((chain_steps > 0).sum(dim=1).max()), 1)
    order = torch.sort(-chain_steps, dim=1, stable=True).indices[:, :width]  # (B, R)
    slot_steps = chain_steps.gather(1, order)  # (B, R)
    return torch.where(slot_steps > 0, order, torch.zeros_like(order)), slot_steps


def step_widths(slot_steps: torch.Tensor, steps: int) -> list[int]:
    """The slots step j runs on, for j < ``steps``: the most chains of any batch row reaching it
    (at least 1, so a step's states keep their shape)."""
    reaching = slot_steps[..., None] > torch.arange(steps, device=slot_steps.device)  # (B, R, S)
    return reaching.sum(dim=1).amax(dim=0).clamp(min=1).tolist()


@register_head
class Eagle3Head(DraftHead):
    kind = "eagle3"
    engine_layout = "llama"  # vLLM, SGLang, speculators and llama.cpp build its drafter so
    own_dtype_drafting = True  # its own lm_head; embeddings and features are cast (fuse, step)
    config_class = Eagle3Config
    drafting = "autoregressive"
    batch_catch_up = True
    supports_gradient_checkpointing = True  # the training-time test's steps (``unrolled_step``)

    def __init__(self, config: Eagle3Config, base_config, base_name: str | None = None):
        super().__init__(config, base_config, base_name)
        hidden_size, vocab_size = base_config.hidden_size, base_config.vocab_size
        self._feature_layers = resolve_feature_layers(config, base_config.num_hidden_layers)
        self.draft_vocab_size = resolve_draft_vocab_size(config, vocab_size)

        self.fc = nn.Linear(len(self._feature_layers) * hidden_size, hidden_size, bias=False)
        width = {"intermediate_size": config.intermediate_size} if config.intermediate_size else {}
        self.layer_config = draft_layer_base(base_config, config.layer_architecture)
        if config.fc_norm:  # one norm per captured layer, in feature_layers order
            self.fc_norm = nn.ModuleList(build_rms_norm(self.layer_config) for _ in self._feature_layers)
        self.midlayer = build_decoder_layer(
            self.layer_config, layer_idx=0, **width
        )  # checks the architecture
        self.intermediate_size = config.intermediate_size or base_config.intermediate_size
        attention = self.midlayer.self_attn
        attention.q_proj = replace_linear_input(attention.q_proj, 2 * hidden_size)
        attention.k_proj = replace_linear_input(attention.k_proj, 2 * hidden_size)
        attention.v_proj = replace_linear_input(attention.v_proj, 2 * hidden_size)
        self.midlayer.hidden_norm = build_rms_norm(self.layer_config)  # registered once, here (export name)
        # Layers after the midlayer (none by default, so one-layer heads keep the release's names).
        self.layers = nn.ModuleList(
            build_decoder_layer(self.layer_config, layer_idx=index, **width)
            for index in range(1, config.num_layers)
        )
        self.norm = build_rms_norm(self.layer_config)
        self.lm_head = nn.Linear(hidden_size, self.draft_vocab_size, bias=False)
        self.rotary_emb = build_rotary_embedding(self.layer_config)  # buffers only, not saved

        # Until init_from_data sets them: the draft vocabulary is the first N target ids.
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # ---- features and vocabulary --------------------------------------------------------------

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self._feature_layers

    def select_features(self, hidden_states) -> torch.Tensor:
        """(B, T, 3h): the ``feature_layers`` entries of ``hidden_states``, concatenated in order."""
        return torch.cat([hidden_states[index] for index in self._feature_layers], dim=-1)

    def init_from_base(self, base_model) -> None:
        """With ``init_from_base``: the draft layer, final norm (and, once the draft vocabulary is
        known, lm_head) start as the base's; without it, nothing is copied."""
        if not self.config.init_from_base:
            return
        if self.layer_config.model_type != base_model.config.model_type:
            raise ConfigError(
                "head.init_from_base copies the base's last decoder layer "
                f"({base_model.config.model_type}); head.layer_architecture="
                f"{self.config.layer_architecture} builds another layout (drop one of the two)"
            )
        if self.intermediate_size != base_model.config.intermediate_size:
            base_width = base_model.config.intermediate_size
            raise ConfigError(
                f"head.init_from_base copies the base's last decoder layer, whose MLP is {base_width} "
                f"wide; head.intermediate_size={self.intermediate_size} does not fit it (drop one of the two)"
            )
        decoder = base_model.get_decoder()
        state = dict(decoder.layers[-1].state_dict())
        # The base layer's input norm normalises hidden states: here that is g's norm; the
        # embedding's norm keeps its fresh weights.
        state["hidden_norm.weight"] = state.pop("input_layernorm.weight")
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = state[f"self_attn.{name}.weight"]  # (out, h) -> (out, 2h): [embedding | g]
            state[f"self_attn.{name}.weight"] = torch.cat([torch.zeros_like(weight), weight], dim=1)
        missing, unexpected = self.midlayer.load_state_dict(state, strict=False)
        if unexpected or set(missing) != {"input_layernorm.weight"}:
            raise ConfigError(
                f"head.init_from_base: the base's last decoder layer does not fit the draft layer "
                f"(missing {missing}, unexpected {unexpected})"
            )
        self.norm.load_state_dict(decoder.norm.state_dict())
        self._lm_head_from_base(base_model.get_output_embeddings().weight)

    def load_saved(self, saved: DraftHead, token_counts: torch.Tensor | None = None) -> None:
        """Take ``saved``'s weights; if its MLPs are narrower, grow each without changing what it drafts
        (function-preserving widening, Chen et al. 2016, "Net2Net", arXiv 1511.05641): its units
        fill the first rows of gate/up and columns of down_proj; the new units keep their fresh
        gate/up weights and start with zero down_proj columns, so they add nothing until trained.
        If its draft vocabulary is smaller, grow that too (``grow_draft_vocabulary``, which needs
        this run's ``token_counts``). If it has fewer draft layers, the added ones come after its
        layers and start as the identity: fresh weights, but zero ``o_proj`` and ``down_proj``, so
        neither residual branch adds anything until trained (as zero-initialised residual
        branches, Goyal et al. 2017, arXiv 1706.02677, and LoRA's zero B, arXiv 2106.09685)."""
        layers, saved_layers = self.config.num_layers, saved.config.num_layers
        if saved_layers > layers:
            raise ConfigError(
                f"the saved head has {saved_layers} draft layers, this run's head.num_layers is "
                f"{layers}: a head can grow, not shrink"
            )
        width, saved_width = self.intermediate_size, saved.intermediate_size
        if saved_width > width:
            raise ConfigError(
                f"the saved head's draft MLP is {saved_width} wide, this run's head.intermediate_size "
                f"is {width}: a head can grow, not shrink"
            )
        size, saved_size = self.draft_vocab_size, saved.draft_vocab_size
        if saved_size > size:
            raise ConfigError(
                f"the saved head's draft vocabulary has {saved_size} ids, this run's "
                f"head.draft_vocab_size is {size}: a head can grow, not shrink"
            )
        state = saved.state_dict()
        if saved_size < size:
            if token_counts is None:
                raise ConfigError(
                    f"growing the draft vocabulary from {saved_size} to {size} ids needs the training "
                    "split's token counts, to choose the ids it adds"
                )
            draft_ids, rows = grow_draft_vocabulary(
                saved.draft_target_ids(),
                state["lm_head.weight"],
                self.base_lm_head.weight,
                token_counts,
                size,
            )
            state["lm_head.weight"] = rows
            state["d2t"], state["t2d"] = vocabulary_maps(draft_ids, self.base_spec.vocab_size)
        ours = self.state_dict()
        if saved_width < width:
            for mlp in ["midlayer.mlp.", *(f"layers.{i}.mlp." for i in range(len(saved.layers)))]:
                for name in ("gate_proj.weight", "up_proj.weight"):  # (I, h): fresh rows for new units
                    state[mlp + name] = torch.cat([state[mlp + name], ours[mlp + name][saved_width:]], dim=0)
                down = state[mlp + "down_proj.weight"]  # (h, I): new units' columns start at zero
                new_columns = down.new_zeros(down.shape[0], width - saved_width)
                state[mlp + "down_proj.weight"] = torch.cat([down, new_columns], dim=1)
        added = tuple(f"layers.{i}." for i in range(len(saved.layers), len(self.layers)))
        for name, value in ours.items():
            if name.startswith(added):
                residual_output = ".self_attn.o_proj." in name or ".mlp.down_proj." in name
                state[name] = torch.zeros_like(value) if residual_output else value
        self.load_state_dict(state)

    def _lm_head_from_base(self, base_lm_head_weight: torch.Tensor) -> None:
        """lm_head row d := the base lm_head's row of draft id d's target (``init_from_base``)."""
        targets = self.draft_target_ids()
        with torch.no_grad():
            self.lm_head.weight.copy_(base_lm_head_weight[targets.to(base_lm_head_weight.device)])

    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Draft vocabulary = the N most frequent target ids (ties: lower id first), kept in id
        order as the EAGLE-3 reference does, so ``d2t[d] = target_id(d) - d`` is non-decreasing.
        With ``init_from_base``, lm_head's rows follow: row d is the base lm_head's row of id d's
        target."""
        vocab_size = self.base_spec.vocab_size
        if token_counts.shape != (vocab_size,):
            raise ValueError(f"token_counts must have shape ({vocab_size},), got {tuple(token_counts.shape)}")
        draft_ids = by_frequency(token_counts)[: self.draft_vocab_size].sort().values  # (N,)
        d2t, t2d = vocabulary_maps(draft_ids, vocab_size)
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
        if self.config.init_from_base:
            self._lm_head_from_base(self.base_lm_head.weight)

    def draft_to_target(self, token_ids: torch.Tensor) -> torch.Tensor:
        return token_ids + self.d2t[token_ids]

    def draft_target_ids(self) -> torch.Tensor:
        """(N,) the target ids of the draft vocabulary, ascending (draft id order): indices, where
        the ``t2d`` mask would make a selection's size depend on its values."""
        return self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))

    # ---- the drafter --------------------------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, 3h) concatenated base features -> (B, T, h) drafter input g, in the head's dtype."""
        features = features.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            chunks = features.split(self.base_spec.hidden_size, dim=-1)  # 3 x (B, T, h)
            features = torch.cat(
                [norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1
            )
        return self.fc(features)

    def step(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | StepKeys | None,
    ) -> torch.Tensor:
        """One midlayer pass: (B, T, h) state + (B, T) tokens -> (B, T, h) next state (pre-norm, or
        normed with ``norm_output``).
        ``attention_mask`` is additive (B, 1, T, past + T); ``cache`` is extended in place."""
        layer = self.midlayer
        embeddings = self.embed_tokens(token_ids).to(hidden.dtype)  # (B, T, h)
        if attention_mask is not None:  # a mask built in the base's dtype
            attention_mask = attention_mask.to(hidden.dtype)
        attention_input = torch.cat(
            [layer.input_layernorm(embeddings), layer.hidden_norm(hidden)], dim=-1
        )  # (B, T, 2h)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        attended, _ = layer.self_attn(
            hidden_states=attention_input,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwargs(cache),
            position_embeddings=position_embeddings,
        )  # (B, T, h)
        model_type = self.layer_config.model_type
        hidden = add_attention(layer, model_type, hidden, attended)
        hidden = add_feed_forward(layer, model_type, hidden)  # (B, T, h)
        for later in self.layers:
            hidden = later(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_kwargs(cache),
                position_embeddings=position_embeddings,
            )  # (B, T, h)
        return self.norm(hidden) if self.config.norm_output else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., h) drafter state -> (..., N) draft-vocabulary logits (with ``norm_output`` the
        state is already the final norm's output)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    def training_time_test(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rows: torch.Tensor | ChainSlots | None = None,
    ) -> UnrolledRows:
        """Unroll the drafter ``ttt_steps`` times over a training batch (EAGLE-3's training-time test).

        Step j, row i sits at position i + j, consumes token t_{i+j+1} and the state row i produced
        at step j - 1 (step 0: g_i), and predicts t_{i+j+2}. It attends causally to step-0 rows
        (real features) and, in steps 1..j, only to its own row: exactly the keys a depth-j draft
        node sees at inference (prefix cache + its own ancestors).

        Step 0 always runs over every row (they are the keys of all later steps). ``rows`` (B, T)
        picks the rows whose chains are scored: bool, True for every step; long, the number of
        steps row i's chain runs (0: none; COD sampling ends chains early). Step j runs on the rows
        whose chains reach it alone, since a row reads no other row's later steps. None: every row,
        every step (rows with i + j + 2 >= T are then padding). ``ChainSlots`` laid out on the host
        beforehand (``ChainSlots.of``) spare the device-to-host reads of laying them out here.
        """
        batch, length = input_ids.shape
        device = features.device
        steps = self.config.ttt_steps
        hidden = self.fuse(features)  # (B, T, h)
        causal = padded_causal_mask(attention_mask, batch, length, hidden.dtype, device)  # (B, 1, T, T)
        positions = torch.arange(length, device=device)[None].expand(batch, length)  # (B, T)
        # Step 0 runs over every row: its keys are the prefix every later step attends to.
        hidden, keys = self.unrolled_step(
            hidden, shift_left(input_ids, 1), positions, causal, ()
        )  # (B, T, h)

        if rows is None:
            chains = ChainSlots.every_row(batch, length, steps, device)
        else:
            chains = rows if isinstance(rows, ChainSlots) else ChainSlots.of(rows, steps)
            batch_rows = torch.arange(batch, device=device)[:, None]
            hidden = hidden[batch_rows, chains.index]  # (B, R, h)
            causal = causal[batch_rows, :, chains.index].transpose(1, 2)  # (B, 1, R, T)
        index, widths = chains.index, chains.widths
        states = [hidden]
        for step in range(1, steps):
            width = widths[step]
            # Slot s of every step is the same chain: a step-j row sees its own slot in steps 1..j
            # (the diagonal of each of those steps' keys; ``ttt_attention.step_attention``).
            mask = StepMask(causal[:, :, :width], tuple(widths[1 : step + 1]))
            at = index[:, :width]  # (B, R_j)
            tokens = input_ids.gather(1, (at + step + 1).clamp(max=length - 1))  # (B, R_j)
            hidden, keys = self.unrolled_step(hidden[:, :width], tokens, at + step, mask, keys)
            states.append(hidden)
        return UnrolledRows(states, chains)

    def unrolled_step(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | StepMask,
        earlier: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    ) -> tuple[torch.Tensor, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        """One training-time-test step: (B, R, h) states and (B, R) tokens (step 0: the fused
        features and a tensor mask; later steps: the previous step's states and a ``StepMask``) ->
        the next states and every draft layer's keys and values so far (``StepKeys``). With
        ``gradient_checkpointing`` on, in training, the step keeps only its inputs and outputs and
        runs again in the backward pass."""
        widths = mask.widths if isinstance(mask, StepMask) else None
        prefix = mask.prefix if widths is not None else mask

        def run(hidden, tokens, positions, prefix, *flat):
            keys = StepKeys(tuple(zip(flat[0::2], flat[1::2], strict=True)))
            if widths is not None:
                hidden, tokens = self.later_step_inputs(hidden, tokens)
            step_mask = prefix if widths is None else StepMask(prefix, widths)
            out = self.step(hidden, tokens, positions, step_mask, keys)
            return (out, *(tensor for pair in keys.layers() for tensor in pair))

        inputs = (hidden, tokens, positions, prefix, *(tensor for pair in earlier for tensor in pair))
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            outputs = checkpoint(run, *inputs, use_reentrant=False)
        else:
            outputs = run(*inputs)
        return outputs[0], tuple(zip(outputs[1::2], outputs[2::2], strict=True))

    def later_step_inputs(
        self, hidden: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What TTT step j >= 1 of a row consumes, given its step j - 1 state and the data's next
        tokens (B, R): here both, as a depth-j draft node does (P-EAGLE replaces them)."""
        return hidden, tokens

    # ---- drafting -----------------------------------------------------------------------------

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    def catch_up(self, cache, features, next_token_ids, position_ids, attention_mask=None):
        """See ``DraftHead.catch_up``; ``features`` are (B, T, 3h). ``cache`` must hold exactly the
        accepted rows before ``position_ids[:, 0]``: crop rows written by ``draft_step`` first."""
        hidden = self.fuse(features)  # (B, T, h)
        batch, length, _ = hidden.shape
        mask = attention_mask
        if mask is None:
            mask = prefix_causal_mask(batch, cache.get_seq_length(), length, hidden.dtype, hidden.device)
        hidden = self.step(hidden, next_token_ids, position_ids, mask, cache)[:, -1]  # (B, h)
        return hidden, self.logits(hidden)  # (B, h), (B, N)

    def draft_step(self, cache, depth, hidden, token_ids, position_ids, attention_mask):
        """See ``DraftHead.draft_step``. A node at depth d consumes its parent's state and its own
        token (a base-vocabulary id); drafter position = last catch-up position + d; it should see
        the cached prefix, its ancestors' rows and itself. Logits are over the draft vocabulary
        (map ids with ``draft_to_target``)."""
        hidden = self.step(hidden, token_ids, position_ids, attention_mask, cache)  # (B, N, h)
        return hidden, self.logits(hidden)  # (B, N, h), (B, N, N_draft)
