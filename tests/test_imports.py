"""The package's import graph: no cycle among module-level imports, every module imports on its own in
dependency order in a fresh process, and the layering holds (nothing imports ``train``; ``heads``
imports neither ``infer``, ``train`` nor ``export`` at module level; ``infer`` never ``train``)."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import draftheads

PACKAGE = Path(draftheads.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports when it is imported (function bodies excluded)."""
    found = set()
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
                # Importing a.b.c first runs the packages a and a.b: edges to those the importer is
                # not itself inside (a package's __init__ importing its own submodules is no cycle).
                parent = target.rpartition(".")[0]
                while parent and parent in modules and not (name + ".").startswith(parent + "."):
                    found.add(parent)
                    parent = parent.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: module_level_imports(path, modules) for name, path in paths.items()}


def test_no_import_cycle_and_every_module_imports_alone_in_dependency_order():
    graph = import_graph()
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run(
        [sys.executable, "-c", script, *order], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_layering():
    graph = import_graph()

    def importers_of(prefix: str, among: str) -> list[str]:
        return sorted(
            f"{name} -> {target}"
            for name, targets in graph.items()
            if name.startswith(among)
            for target in targets
            if target.startswith(prefix)
        )

    outside_train = [
        edge
        for edge in importers_of("draftheads.train", "draftheads.")
        if not edge.startswith(("draftheads.train", "draftheads.commands"))
    ]
    assert outside_train == []
    for layer in ("draftheads.infer", "draftheads.train", "draftheads.export", "draftheads.tuning"):
        assert importers_of(layer, "draftheads.heads") == []
    assert importers_of("draftheads.train", "draftheads.infer") == []
    assert importers_of("draftheads.export", "draftheads.infer") == []


def test_decoding_export_and_tuning_need_no_training_extras():
    """What a core install (no ``[train]`` extra) runs: importing these pulls in none of the extras."""
    modules = [
        "draftheads.infer.generate",
        "draftheads.commands.generate",
        "draftheads.commands.bench",
        "draftheads.commands.tune_tree",
        "draftheads.commands.export",
        "draftheads.tuning.tune",
        "draftheads.export",
        "draftheads.heads",
    ]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "extras = ('deepspeed', 'wandb', 'datasets', 'peft', 'matplotlib')\n"
        "print(sorted(m for m in extras if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_train_without_its_extras_says_what_to_install(monkeypatch, capsys):
    from draftheads import optional
    from draftheads.cli import main

    monkeypatch.setattr(optional, "available", lambda module: module != "deepspeed")
    assert main(["train", "--config", "configs/smollm2_medusa_cpu.yaml"]) == 5
    assert "needs deepspeed: pip install 'draftheads[train]'" in capsys.readouterr().err
