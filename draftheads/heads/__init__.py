"""Draft heads: the interface and registry (``base``) and one module per family.

Importing this package registers the built-in kinds; it depends on torch and transformers only.
"""

from draftheads.heads.base import (
    HEAD_REGISTRY,
    BaseModelSpec,
    DraftHead,
    HeadConfig,
    HeadFormatError,
    HeadMismatchError,
    build_head,
    head_class,
    load_head,
    load_head_and_base,
    register_head,
    resolve_base_model,
)

# Importing the families registers them (``@register_head``); nothing else runs at import time.
from draftheads.heads.dflash import DFlashConfig, DFlashHead
from draftheads.heads.eagle import EagleConfig, EagleHead
from draftheads.heads.eagle3 import Eagle3Config, Eagle3Head
from draftheads.heads.medusa import MedusaConfig, MedusaHead
from draftheads.heads.mtp import MtpConfig, MtpHead
from draftheads.heads.peagle import PEagleConfig, PEagleHead

__all__ = [
    "HEAD_REGISTRY",
    "BaseModelSpec",
    "DFlashConfig",
    "DFlashHead",
    "DraftHead",
    "Eagle3Config",
    "Eagle3Head",
    "EagleConfig",
    "EagleHead",
    "HeadConfig",
    "HeadFormatError",
    "HeadMismatchError",
    "MedusaConfig",
    "MedusaHead",
    "MtpConfig",
    "MtpHead",
    "PEagleConfig",
    "PEagleHead",
    "build_head",
    "head_class",
    "load_head",
    "load_head_and_base",
    "register_head",
    "resolve_base_model",
]
