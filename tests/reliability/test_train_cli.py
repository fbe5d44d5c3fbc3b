"""`draftheads train` into a directory another run holds: one line naming the holder, exit 2,
before any model is loaded; --allow-changed-data reaches the training loop."""

from __future__ import annotations

from pathlib import Path

import draftheads.train.loop
from draftheads.cli import main
from draftheads.train.lock import OutputLock

MEDUSA = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2_medusa_cpu.yaml")


def test_a_locked_output_dir_is_one_line_naming_the_holder(tmp_path, capsys):
    with OutputLock.acquire(tmp_path / "run"):
        code = main(["train", "--config", MEDUSA, f"train.output_dir={tmp_path / 'run'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "is in use by another run (pid" in err and "Traceback" not in err


def test_allow_changed_data_is_passed_to_the_loop(monkeypatch):
    seen = {}

    def record(run, **options):
        seen.update(options)

    monkeypatch.setattr(draftheads.train.loop, "run_training", record)
    assert main(["train", "--config", MEDUSA, "--allow-changed-data"]) == 0
    assert seen == {"allow_changed_data": True}
    assert main(["train", "--config", MEDUSA]) == 0
    assert seen == {"allow_changed_data": False}
