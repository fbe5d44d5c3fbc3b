import os
from pathlib import Path

import pytest

from draftheads.cli import main, take_launcher_rank

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


@pytest.mark.parametrize(
    "launcher_argv",
    [
        ["--local_rank=3", "train"],  # deepspeed/launcher/launch.py: the flag right after the script
        ["--local-rank=3", "train"],  # torch.distributed.launch's spelling
        ["--local_rank", "3", "train"],
        ["train", "--local_rank=3"],
    ],
)
def test_the_launcher_local_rank_argument_is_accepted(launcher_argv, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    invalid = ["train.epochs=null", "train.max_steps=-1"]
    assert main([*launcher_argv, "--config", MEDUSA, *invalid]) == 3
    assert "train.max_steps must be >= 0" in capsys.readouterr().err
    assert os.environ["LOCAL_RANK"] == "3"


def test_the_launcher_rank_flag_leaves_a_set_local_rank_alone(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    argv = ["--local_rank=1", "cache-features", "--config", MEDUSA]
    take_launcher_rank(argv)
    assert argv == ["cache-features", "--config", MEDUSA]
    assert os.environ["LOCAL_RANK"] == "1"
