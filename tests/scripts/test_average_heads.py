"""scripts/average_heads.py: the mean of float tensors, integer maps kept, mismatches refused."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.scripts.script_loader import load_script


def _script():
    return load_script("average_heads")


def _head(directory: Path, weight: torch.Tensor, d2t: torch.Tensor) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"kind": "eagle3"}))
    save_file({"fc.weight": weight, "d2t": d2t}, str(directory / "model.safetensors"))
    return directory


def test_the_average_is_the_mean_and_keeps_the_vocabulary_map(tmp_path, monkeypatch):
    d2t = torch.tensor([0, 3, 5])
    first = _head(tmp_path / "a", torch.tensor([[1.0, 2.0]]), d2t)
    second = _head(tmp_path / "b", torch.tensor([[3.0, -2.0]]), d2t)
    out = tmp_path / "mean"
    monkeypatch.setattr("sys.argv", ["average_heads.py", str(out), str(first), str(second)])
    _script().main()
    mean = load_file(out / "model.safetensors")
    assert torch.equal(mean["fc.weight"], torch.tensor([[2.0, 0.0]]))
    assert torch.equal(mean["d2t"], d2t)
    assert json.loads((out / "config.json").read_text()) == {"kind": "eagle3"}


def test_heads_with_different_vocabulary_maps_are_refused(tmp_path):
    first = _head(tmp_path / "a", torch.zeros(1, 2), torch.tensor([0, 3, 5]))
    second = _head(tmp_path / "b", torch.zeros(1, 2), torch.tensor([0, 4, 5]))
    with pytest.raises(SystemExit, match="'d2t' differs"):
        _script().average([first, second])


def test_heads_of_different_widths_are_refused(tmp_path):
    first = _head(tmp_path / "a", torch.zeros(1, 2), torch.tensor([0, 3, 5]))
    second = _head(tmp_path / "b", torch.zeros(1, 4), torch.tensor([0, 3, 5]))
    with pytest.raises(SystemExit, match="'fc.weight' has shape"):
        _script().average([first, second])
