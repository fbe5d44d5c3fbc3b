import os
from pathlib import Path

from draftheads.cli import main

MEDUSA = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2_medusa_cpu.yaml")


def test_bad_config_value_exits_3_with_the_field_named(capsys):
    code = main(["train", "--config", MEDUSA, "train.micro_batch_size=0"])
    assert code == 3
    assert "train.micro_batch_size must be >= 1" in capsys.readouterr().err


def test_unknown_key_and_missing_file(capsys, tmp_path):
    assert main(["train", "--config", MEDUSA, "train.micro_batchsize=2"]) == 3
    assert "did you mean 'micro_batch_size'" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "nope.yaml")]) == 3
    assert "nope.yaml" in capsys.readouterr().err


def test_the_launcher_local_rank_argument_is_accepted(capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    invalid = ["train.epochs=null", "train.max_steps=-1"]
    assert main(["train", "--local_rank=3", "--config", MEDUSA, *invalid]) == 3
    assert "train.max_steps must be >= 0" in capsys.readouterr().err
    assert os.environ["LOCAL_RANK"] == "3"
