"""scripts/restrict_vocab.py: a grown EAGLE-3 head restricted to the vocabulary it
grew from is the head it grew from; a vocabulary it does not hold is refused."""

import pytest
import torch

from draftheads.heads import Eagle3Config, build_head, load_head
from tests.scripts.script_loader import load_script


def _script():
    return load_script("restrict_vocab")


def test_restricting_a_grown_head_gives_back_the_head_it_grew_from(tmp_path, tiny_llama, monkeypatch):
    small = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=32))
    small.init_from_data(torch.arange(256, 0, -1).roll(100))  # ids 100-131
    with torch.no_grad():
        small.lm_head.weight.add_(
            torch.randn(small.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    grown = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=48))
    grown.load_saved(small, torch.arange(256, 0, -1))  # adds ids 0-15
    small.save_pretrained(tmp_path / "small")
    grown.save_pretrained(tmp_path / "grown")
    out = tmp_path / "restricted"
    monkeypatch.setattr(
        "sys.argv", ["restrict_vocab.py", str(out), str(tmp_path / "grown"), str(tmp_path / "small")]
    )
    _script().main()
    restricted = load_head(out).state_dict()
    for name, tensor in small.state_dict().items():
        assert torch.equal(restricted[name], tensor), name

    other = build_head(tiny_llama, Eagle3Config(feature_layers=(1, 2, 3), draft_vocab_size=32))
    other.init_from_data(torch.arange(256, 0, -1).roll(200))  # ids 200-231: not in the grown head
    with pytest.raises(SystemExit, match="32 ids of the smaller vocabulary are not in it"):
        _script().restrict(grown.state_dict(), other.state_dict(), "grown")
