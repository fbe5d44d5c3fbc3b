"""Config loading: defaults once, YAML overrides, CLI overrides, clear errors."""

import pytest

from draftheads.config import RunConfig, load_run_config
from draftheads.settings import ConfigError, parse_overrides


def test_defaults_without_file():
    run = load_run_config()
    assert run == RunConfig()
    assert run.head is None


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("# draftheads train --config run.yaml\ntrain:\n  max_steps: 7\n  learning_rate: 1e-3\n")
    run = load_run_config(path, ["train.max_steps=9", "data.limit=5", "train.adam_betas=[0.8, 0.9]"])
    assert run.train.max_steps == 9
    assert run.train.learning_rate == pytest.approx(1e-3)
    assert run.data.limit == 5
    assert run.train.adam_betas == (0.8, 0.9)


def test_a_max_steps_override_that_epochs_would_ignore_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  epochs: 3\n")
    refused = r"train.max_steps=40: .*run.yaml sets train.epochs=3.*train.epochs=null"
    with pytest.raises(ConfigError, match=refused):
        load_run_config(path, ["train.max_steps=40"])
    assert load_run_config(path, ["train.max_steps=40", "train.epochs=null"]).train.max_steps == 40
    assert load_run_config(path, ["train.epochs=2"]).train.epochs == 2


def test_unknown_key_names_key_and_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_step: 7\n")
    with pytest.raises(ConfigError, match=r"unknown key 'max_step'.*did you mean 'max_steps'"):
        load_run_config(path)
    with pytest.raises(ConfigError, match=r"unknown key 'lr'"):
        load_run_config(None, ["train.lr=0.1"])


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"train.max_steps: expected an integer, got 'many'"):
        load_run_config(None, ["train.max_steps=many"])


def test_an_override_or_file_that_cannot_be_parsed_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'train.max_steps=\[': the value '\[' is not valid YAML"):
        load_run_config(None, ["train.max_steps=["])
    with pytest.raises(ConfigError, match=r"override 'data.source=@c.jsonl'.*quote it"):
        parse_overrides(["data.source=@c.jsonl"])
    assert parse_overrides(["data.source='@c.jsonl'"]) == {"data": {"source": "@c.jsonl"}}
    path = tmp_path / "latin1.yaml"
    path.write_bytes("train:\n  output_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 24\)"):
        load_run_config(path)


def test_optional_accepts_null():
    run = load_run_config(None, ["data.limit=null"])
    assert run.data.limit is None


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_overrides(["train.max_steps"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_run_config(bad)


def test_head_section_needs_known_kind():
    with pytest.raises(ConfigError, match="needs 'kind'"):
        load_run_config(None, ["head.num_heads=3"])
    with pytest.raises(ConfigError, match="unknown head kind 'medusa9'"):
        load_run_config(None, ["head.kind=medusa9"])


def test_a_loss_token_fraction_outside_zero_one_is_refused():
    with pytest.raises(ConfigError, match=r"loss_token_fraction must be in \(0, 1\], got 0.0"):
        load_run_config(None, ["train.loss_token_fraction=0"])
    assert load_run_config(None, ["train.loss_token_fraction=0.5"]).train.loss_token_fraction == 0.5


def test_values_that_cannot_work_are_refused_when_loading(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  micro_batch_size: 0\n")
    with pytest.raises(ConfigError, match=r"run.yaml: train.micro_batch_size must be >= 1, got 0"):
        load_run_config(path)
    with pytest.raises(ConfigError, match=r"joint.lora_rank must be >= 1, got 0"):
        load_run_config(None, ["joint.lora_rank=0"])
    with pytest.raises(ConfigError, match=r"train.max_steps must be >= 0, got -1"):
        load_run_config(None, ["train.max_steps=-1"])
    assert load_run_config(None, ["train.max_steps=0"]).train.max_steps == 0  # scores the starting head
    with pytest.raises(ConfigError, match=r"train.max_steps=0 .* needs train.epochs=null; train.epochs=2"):
        load_run_config(None, ["train.max_steps=0", "train.epochs=2"])
