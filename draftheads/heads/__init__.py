"""Draft heads: the interface and registry (``base``) and one module per family.

Importing this package registers the built-in kinds; it depends on torch and transformers only.
"""

from draftheads.heads.base import (
    HEAD_REGISTRY,
    BaseModelSpec,
    DraftHead,
    HeadConfig,
    HeadMismatchError,
    build_head,
    head_class,
    load_head,
    register_head,
)

__all__ = [
    "HEAD_REGISTRY",
    "BaseModelSpec",
    "DraftHead",
    "HeadConfig",
    "HeadMismatchError",
    "build_head",
    "head_class",
    "load_head",
    "register_head",
]
