"""Lossless tree-based speculative decoding with a draft head on an unmodified HF model.

``tree`` (shapes, masks), ``verify`` (acceptance rules), ``cache`` (KV compaction), ``draft`` (a
head's proposals) and ``generate`` (the decode loop and ``SpeculativeGenerator``). Importing this
package loads torch only; ``SpeculativeGenerator`` and friends are imported on first use.
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
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'draftheads.infer' has no attribute '{name}'")
