"""Lossless tree-based speculative decoding on an unmodified HF model.

``tree`` (shapes, masks), ``forward`` (the verification forward), ``verify`` (acceptance rules),
``cache`` (KV compaction), ``verify_cost`` (what verifying N tokens costs), the Drafters (``draft``: a
head's proposals; ``context``: n-gram continuations of the text; ``suffix``: continuations of long
matches in the text and in earlier answers; ``hybrid``: a head's and the text's merged;
``adaptive``: pruned to what pays) and ``generate`` (the decode loop and ``SpeculativeGenerator``).
Importing this package loads torch only; ``SpeculativeGenerator`` and friends load on first use.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "SpeculativeGenerator": "draftheads.infer.generate",
    "GenerationResult": "draftheads.infer.generate",
    "GenerationStats": "draftheads.infer.generate",
    "SamplingParams": "draftheads.infer.verify",
    "StaticTree": "draftheads.infer.tree",
    "DynamicTree": "draftheads.infer.tree",
    "TREES": "draftheads.infer.tree",
    "ContextTree": "draftheads.infer.context",
    "HybridTree": "draftheads.infer.hybrid",
    "SuffixTree": "draftheads.infer.suffix",
    "SuffixHistory": "draftheads.infer.suffix",
    "CostCurve": "draftheads.infer.verify_cost",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'draftheads.infer' has no attribute '{name}'")
