"""Two processes converting the embedded GGUF at once on a cold cache: the second keeps the first's."""

import pytest

from draftheads.base_model import move_into_place


def _conversion(path, marker):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "SOURCE").write_text(marker)
    return path


def test_a_conversion_finished_by_another_process_is_kept(tmp_path):
    target = _conversion(tmp_path / "model", "first")
    mine = _conversion(tmp_path / "model.tmp-1", "second")
    move_into_place(mine, target)  # os.replace fails: target is a non-empty directory
    assert (target / "SOURCE").read_text() == "first"


def test_a_target_that_is_not_a_finished_conversion_still_fails(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stray").write_text("not a model")
    mine = _conversion(tmp_path / "model.tmp-1", "second")
    with pytest.raises(OSError):
        move_into_place(mine, target)
    assert (target / "stray").read_text() == "not a model"


def test_the_first_conversion_moves_into_place(tmp_path):
    mine = _conversion(tmp_path / "model.tmp-1", "first")
    move_into_place(mine, tmp_path / "model")
    assert (tmp_path / "model" / "SOURCE").read_text() == "first" and not mine.exists()
