"""Optional dependencies: the core install decodes, exports and tunes; training, Medusa-2 adapters
and charts need extras (``pip install 'draftheads[train]'``, ``[adapters]``, ``[plots]``)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# The importable modules behind each extra of pyproject.toml that a command checks for up front.
EXTRA_MODULES = {
    "train": ("deepspeed", "datasets", "peft", "wandb", "matplotlib"),
    "adapters": ("peft",),
    "plots": ("matplotlib",),
}


class MissingDependencyError(ImportError):
    """An optional package a feature needs is not installed; the message says which extra has it."""


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"{purpose} needs the '{module}' package: pip install 'draftheads[{extra}]'"
        ) from err


def require_extra(extra: str, purpose: str) -> None:
    """Raise MissingDependencyError listing the modules of ``extra`` that are not installed."""
    missing = [module for module in EXTRA_MODULES[extra] if not available(module)]
    if missing:
        raise MissingDependencyError(
            f"{purpose} needs {', '.join(missing)}: pip install 'draftheads[{extra}]'"
        )
