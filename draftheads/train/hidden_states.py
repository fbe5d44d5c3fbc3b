"""Where a batch's base hidden states come from: the frozen base (online) or a cache (offline).

Each source is a callable ``(batch, split) -> hidden_states`` that ``FrozenBaseRecipe`` calls for
every training and evaluation batch; ``compute_objective`` accepts what either returns (the HF
tuple, or a dict index -> (B, T, h) holding the head's ``required_hidden_states``). A source's
``base_argmax(batch, split)`` gives the base model's next-token argmax (B, T) where it is known
without running lm_head (a feature cache stores it), else None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from draftheads.train.metrics import base_hidden_states

# The batch entries ``CachedHiddenStates.host_inputs`` adds.
STATES_KEY = "hidden_states.{}"
ARGMAX_KEY = "base_argmax"


class HiddenStateSource(Protocol):
    def __call__(self, batch: dict, split: str) -> Any:
        """The base's hidden states for ``batch`` of ``split``."""

    def host_inputs(self, host_batch: dict, split: str) -> dict[str, torch.Tensor]:
        """What can be read for ``host_batch`` on the host before it moves to the device (a
        cache's rows), as more batch entries; the call then takes them from the batch."""

    def base_argmax(self, batch: dict, split: str) -> torch.Tensor | None:
        """(B, T) the base's next-token argmax at each position, or None where not at hand."""


@dataclass(frozen=True)
class OnlineHiddenStates:
    """Run the frozen base model's body on each batch, keeping the states in ``layers`` (the
    head's ``required_hidden_states``; None: all)."""

    base_model: Any
    layers: tuple[int, ...] | None = None

    def __call__(self, batch: dict, split: str) -> tuple:
        # Batches are right-padded (``batching.collate``): under the causal mask a real token sees
        # real tokens alone, so its states are the same without the padding mask, which would only
        # make transformers read it on the host (a sync) and keep SDPA from its fused causal kernel.
        # Padding rows' states differ; nothing reads them (the heads mask padding themselves).
        return base_hidden_states(self.base_model, batch["input_ids"], None, self.layers)

    def host_inputs(self, host_batch: dict, split: str) -> dict[str, torch.Tensor]:
        return {}  # the base runs on the device

    def base_argmax(self, batch: dict, split: str) -> None:
        return None  # the body runs without lm_head: the objective projects only the rows it needs


@dataclass(frozen=True)
class CachedHiddenStates:
    """Read each batch's rows from a feature cache (``draftheads cache-features``), upcast to the
    training dtype. Batches carry ``row_index`` (B,): their rows in ``split``'s dataset."""

    cache: Any  # draftheads.data.feature_reader.FeatureCache
    dtype: torch.dtype
    layers: tuple[int, ...]  # the head's required_hidden_states (the cache may hold more)

    def __call__(self, batch: dict, split: str) -> dict[int, torch.Tensor]:
        if STATES_KEY.format(self.layers[0]) in batch:  # read on the host (``host_inputs``)
            return {layer: batch[STATES_KEY.format(layer)].to(self.dtype) for layer in self.layers}
        rows = batch["row_index"].tolist()
        return self.cache.batch(split, rows, batch["input_ids"], self.dtype, self.layers)

    def base_argmax(self, batch: dict, split: str) -> torch.Tensor | None:
        if STATES_KEY.format(self.layers[0]) in batch:
            return batch.get(ARGMAX_KEY)
        return self.cache.base_argmax(split, batch["row_index"].tolist(), batch["input_ids"])

    def host_inputs(self, host_batch: dict, split: str) -> dict[str, torch.Tensor]:
        """The batch's rows read from the cache on the host, in the cache's storage dtype (cast on
        the device): ``hidden_states.L`` (B, T, h) per layer and, where stored, ``base_argmax``."""
        rows, input_ids = host_batch["row_index"].tolist(), host_batch["input_ids"]
        states = self.cache.batch(split, rows, input_ids, self.cache.storage_dtype, self.layers)
        inputs = {STATES_KEY.format(layer): state for layer, state in states.items()}
        argmax = self.cache.base_argmax(split, rows, input_ids)
        return inputs if argmax is None else {**inputs, ARGMAX_KEY: argmax}


def open_feature_cache(
    directory: str,
    base_model,
    base_name: str,
    tokenizer,
    head,
    splits: dict,
    max_length: int,
    dtype: torch.dtype,
) -> CachedHiddenStates:
    """The cache at ``directory``, after checking it was made for this base model, tokenizer and
    rows and holds the hidden states ``head`` reads (FeatureCacheError naming the first field that
    differs); a cache written for another head kind serves if it holds them."""
    from draftheads.data.feature_identity import CacheIdentity
    from draftheads.data.feature_reader import FeatureCache

    cache = FeatureCache(directory)
    cache.check(CacheIdentity.build(base_model, base_name, tokenizer, head, splits, max_length))
    return CachedHiddenStates(cache, dtype, tuple(head.required_hidden_states))
