"""`draftheads train` into a directory another run holds: one line naming the holder, exit 2,
before any model is loaded; --allow-changed-data and --overwrite reach the training loop; a
setting of the wrong type is named with its value and the type expected."""

from __future__ import annotations

from pathlib import Path

import draftheads.commands.train
import draftheads.train.loop
from draftheads.cli import main
from draftheads.train.lock import OutputLock

MEDUSA = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2_medusa_cpu.yaml")


def test_a_locked_output_dir_is_one_line_naming_the_holder(tmp_path, capsys):
    with OutputLock.acquire(tmp_path / "run"):
        code = main(["train", "--config", MEDUSA, f"train.output_dir={tmp_path / 'run'}"])
    assert code == 6
    err = capsys.readouterr().err
    assert "is in use by another run (pid" in err and "Traceback" not in err


def test_allow_changed_data_and_overwrite_are_passed_to_the_loop(monkeypatch, tmp_path):
    seen = {}

    def record(run, **options):
        seen.update(options)

    monkeypatch.setattr(draftheads.commands.train, "print_data_summary", lambda run: None)
    monkeypatch.setattr(draftheads.train.loop, "run_training", record)
    output = f"train.output_dir={tmp_path / 'run'}"
    assert main(["train", "--config", MEDUSA, output, "--allow-changed-data"]) == 0
    assert seen == {"allow_changed_data": True, "overwrite": False}
    assert main(["train", "--config", MEDUSA, output, "--overwrite"]) == 0
    assert seen == {"allow_changed_data": False, "overwrite": True}


def test_a_value_of_the_wrong_type_names_field_value_and_type(capsys):
    # The shipped config sets train.epochs, so a max_steps override is otherwise refused as ignored.
    assert main(["train", "--config", MEDUSA, "train.max_steps=abc"]) != 0
    err = capsys.readouterr().err
    assert "train.max_steps: expected an integer, got 'abc'" in err and "epochs" not in err
