"""``draftheads export``: the command, the model card, and the Hub upload through a local stand-in.

The upload test runs the real ``huggingface_hub`` client (HfApi.create_repo + upload_folder)
against ``hub_standin.HubStandIn`` on 127.0.0.1; the client is only pointed there (endpoint) and
told it may go online (the test suite sets HF_HUB_OFFLINE=1 globally).
"""

from __future__ import annotations

import json

import pytest
import torch
from hub_standin import HubStandIn
from safetensors.torch import load_file

from draftheads.cli import main
from draftheads.export import write_head
from draftheads.export.destination import MANIFEST_NAME
from draftheads.heads import build_head, load_head
from draftheads.heads.eagle3 import Eagle3Config
from draftheads.heads.medusa import MedusaConfig

TRAINING = {
    "steps": 1200,
    "tokens": 3_400_000,
    "wall_seconds": 5400.0,
    "tokens_per_second": 630.0,
    "base_forward_tokens_per_second": None,
    "data_source": "sharegpt (embedded)",
    "train_examples": 9000,
    "eval": {
        "loss": 2.5,
        "top1": [0.61, 0.38],
        "top5": [0.85, 0.66],
        "counted": [5000, 5000],
        "chain_acceptance": 1.84,
    },
    "head_dir": "runs/x/head",
}
BENCH = {
    "tau_convention": (
        "tokens per base-model forward, counting the token the base model produces itself "
        "(plain decoding = 1)"
    ),
    "machine": {"cpu": "test"},
    "settings": {},
    "summaries": [
        {
            "method": "plain",
            "category": "all",
            "prompts": 8,
            "tokens": 512,
            "seconds": 10.0,
            "tokens_per_second": 51.2,
            "tau": 1.0,
            "speedup": 1.0,
            "implied_overhead": 1.0,
            "acceptance_by_depth": [],
            "agreement": 1.0,
        },
        {
            "method": "medusa",
            "category": "all",
            "prompts": 8,
            "tokens": 512,
            "seconds": 6.0,
            "tokens_per_second": 85.3,
            "tau": 2.1,
            "speedup": 1.67,
            "implied_overhead": 1.26,
            "acceptance_by_depth": [0.6, 0.3],
            "agreement": 1.0,
        },
    ],
    "samples": [],
}


@pytest.fixture
def trained_medusa_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    directory = head.save_pretrained(tmp_path / "head", extra={"training": TRAINING})
    (directory / "bench.json").write_text(json.dumps(BENCH))
    return directory


def test_default_export_is_loadable_and_has_a_model_card(trained_medusa_dir, tmp_path, tiny_llama):
    out = tmp_path / "out"
    assert main(["export", "--heads", str(trained_medusa_dir), "--out", str(out)]) == 0
    written = {"config.json", "model.safetensors", "README.md", "bench.json"}
    assert {p.name for p in out.iterdir()} == written | {MANIFEST_NAME}
    loaded = load_head(out, base_model=tiny_llama)
    original = load_head(trained_medusa_dir, base_model=tiny_llama)
    features = torch.randn(1, 3, 64)
    assert torch.equal(loaded.draft_logits(features), original.draft_logits(features))
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: draftheads\nbase_model: tiny-llama\n")
    parameters = 2 * (64 * 64 + 64 + 256 * 64)
    assert f"| head parameters | {parameters:,} |" in card
    assert "| training steps | 1,200 |" in card and "sharegpt (embedded)" in card
    assert "| 1 | 0.61 | 0.85 | 5,000 |" in card and "1.84" in card  # held-out accuracies
    assert "| medusa | 8 | 2.1 | 85.3 | 1.67 | 1 |" in card  # benchmark table from bench.json
    assert "SpeculativeGenerator.from_pretrained(" in card


def test_engine_export_through_the_command(trained_medusa_dir, tmp_path):
    out = tmp_path / "vllm"
    assert (
        main(["export", "--heads", str(trained_medusa_dir), "--format", "medusa-vllm", "--out", str(out)])
        == 0
    )
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MedusaModel"]
    assert "lm_heads.1.weight" in load_file(str(out / "model.safetensors"))
    assert "`medusa-vllm` layout" in (out / "README.md").read_text()


def test_impossible_pair_exits_with_a_clear_message(trained_medusa_dir, tmp_path, capsys):
    code = main(
        ["export", "--heads", str(trained_medusa_dir), "--format", "eagle3", "--out", str(tmp_path / "x")]
    )
    assert code == 4
    assert "cannot express a medusa head" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before writing anything


def test_existing_output_is_not_overwritten_silently(trained_medusa_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--heads", str(trained_medusa_dir), "--out", str(out)]) == 6
    assert "--overwrite" in capsys.readouterr().err and (out / "keep.txt").exists()


def test_a_format_storing_base_tensors_needs_a_base_the_head_names(tiny_llama, tmp_path, capsys):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1, shared_lm_head=True))
    directory = head.save_pretrained(tmp_path / "head")  # the tiny base has no name to record
    code = main(
        ["export", "--heads", str(directory), "--format", "medusa-vllm", "--out", str(tmp_path / "x")]
    )
    assert code == 4
    err = capsys.readouterr().err
    assert f"{directory / 'config.json'}: records no base model (base_model.name_or_path" in err
    assert "--base" in err and not (tmp_path / "x").exists()


def test_engine_checkpoint_converts_back_to_draftheads(tiny_llama, tmp_path):
    head = build_head(
        tiny_llama, Eagle3Config(draft_vocab_size=50, feature_layers=(1, 2, 3)), base_name="tiny-llama"
    )
    write_head(head, tmp_path / "eagle3", "eagle3")
    out = tmp_path / "back"
    assert main(["export", "--heads", str(tmp_path / "eagle3"), "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["format"] == "draftheads" and saved["head_kind"] == "eagle3"
    state, original = load_file(str(out / "model.safetensors")), head.head_state_dict()
    assert state.keys() == original.keys() and all(torch.equal(state[k], original[k]) for k in state)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login leaks in
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    with HubStandIn() as stand_in:
        monkeypatch.setattr(hub_constants, "ENDPOINT", stand_in.endpoint)
        yield stand_in


def test_push_to_hub_uploads_the_export(trained_medusa_dir, tmp_path, hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_test_write_token")
    out = tmp_path / "out"
    code = main(
        [
            "export",
            "--heads",
            str(trained_medusa_dir),
            "--out",
            str(out),
            "--push-to-hub",
            "someone/tiny-medusa",
            "--private",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"{hub.endpoint}/someone/tiny-medusa"
    assert hub.record.created == {"someone/tiny-medusa": True}
    arrived = hub.record.files["someone/tiny-medusa"]
    assert set(arrived) == {"config.json", "model.safetensors", "README.md", "bench.json"}
    for name, content in arrived.items():
        assert content == (out / name).read_bytes()
    assert set(hub.record.authorizations) == {"Bearer hf_test_write_token"}
    assert hub.record.unexpected == []
    assert hub.record.card_metadata == [
        {
            "library_name": "draftheads",
            "base_model": "tiny-llama",
            "tags": ["draftheads", "speculative-decoding", "medusa"],
        }
    ]


def test_push_without_token_is_a_clear_error(trained_medusa_dir, tmp_path, hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    code = main(
        [
            "export",
            "--heads",
            str(trained_medusa_dir),
            "--out",
            str(tmp_path / "out"),
            "--push-to-hub",
            "someone/x",
        ]
    )
    assert code == 5
    assert "no Hugging Face token found: set HF_TOKEN" in capsys.readouterr().err
    assert hub.record.created == {}
