"""Shared by the tests of the scripts beside the training records (docs/results/training/*.py),
which are files, not modules of the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "training"


def load_script(name: str) -> ModuleType:
    """docs/results/training/NAME.py, imported fresh."""
    spec = importlib.util.spec_from_file_location(f"results_training_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
