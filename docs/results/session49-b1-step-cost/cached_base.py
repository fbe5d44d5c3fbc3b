"""What forward_paths.py, forward_ops.py and mask_repeat_ab.py share: the shipped head's packed fp32
base with a prompt of CACHED random tokens prefilled into its cache."""

from dataclasses import dataclass

import torch

from draftheads.infer import SpeculativeGenerator
from draftheads.infer.forward import prefill_forward

HEAD = "docs/results/heads/eagle3-corpus-both"
CACHED = 180


@dataclass
class CachedBase:
    model: object
    layers: tuple[int, ...]  # the hidden states the head reads
    ids: torch.Tensor  # (1, CACHED): the prompt; its first tokens also fill the trees
    cache: object
    slots: torch.Tensor  # (1, CACHED) bool, all occupied


def cached_base() -> CachedBase:
    generator = SpeculativeGenerator.from_pretrained(HEAD, dtype="float32", context=False, adaptive=False)
    layers = tuple(generator.head.feature_layers)
    torch.manual_seed(0)
    ids = torch.randint(100, 20000, (1, CACHED))
    cache, _ = prefill_forward(generator.model, ids, layers)
    return CachedBase(generator.model, layers, ids, cache, torch.ones(1, CACHED, dtype=torch.bool))
