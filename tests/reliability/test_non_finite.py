"""Non-finite numbers: a setting of inf or nan is refused when the config loads, naming the field
and the value; a training step whose loss is not finite stops the run in one line, keeping the last
good checkpoint and saving no head; metrics.jsonl stays valid JSON (null, never NaN)."""

from __future__ import annotations

import json
import math

import pytest

from draftheads.config import load_run_config
from draftheads.settings import ConfigError
from draftheads.train.loop import NonFiniteLossError, run_training
from draftheads.train.reporting import Reporter, read_metrics
from tests.reliability.train_fixtures import MEDUSA, patterned_dataset, short_run

pytestmark = pytest.mark.usefixtures("single_thread")


def _strict_json(line: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ([*MEDUSA, "train.learning_rate=inf"], "inf"),
        ([*MEDUSA, "train.learning_rate=.inf"], "inf"),
        ([*MEDUSA, "train.grad_clip=-inf"], "-inf"),
        ([*MEDUSA, "train.weight_decay=nan"], "nan"),
        ([*MEDUSA, "train.min_lr_ratio=1e999"], "inf"),
        (["head.kind=eagle", "head.feature_noise=.nan"], "nan"),
    ],
)
def test_a_non_finite_setting_is_refused_naming_field_and_value(overrides, shown):
    field = overrides[-1].split("=")[0]
    with pytest.raises(ConfigError, match=rf"{field}: expected a finite number, got {shown}"):
        load_run_config(None, overrides)


def test_a_non_finite_setting_in_a_yaml_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("head:\n  kind: medusa\ntrain:\n  learning_rate: .inf\n")
    with pytest.raises(ConfigError, match=r"run.yaml.train.learning_rate: expected a finite number, got inf"):
        load_run_config(path)


def test_metrics_jsonl_writes_null_for_non_finite_numbers(tmp_path):
    reporter = Reporter(tmp_path)
    reporter.log({"step": 1, "loss": math.nan, "top1": [0.5, math.inf], "eval": {"loss": -math.inf}})
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert _strict_json(line) == {"step": 1, "loss": None, "top1": [0.5, None], "eval": {"loss": None}}


def test_a_non_finite_loss_stops_the_run_keeping_the_last_good_checkpoint(tmp_path, tiny_llama):
    """The base's embeddings turn to NaN from the 4th base forward on: steps 1-2 train, the
    evaluation at step 2 runs and step 2 is checkpointed, step 3's loss is NaN."""
    forwards = []

    def poison(module, inputs, output):
        forwards.append(1)
        return output * math.nan if len(forwards) >= 4 else output

    tiny_llama.model.embed_tokens.register_forward_hook(poison)
    dataset = patterned_dataset()
    output_dir = tmp_path / "run"
    with pytest.raises(
        NonFiniteLossError,
        match=r"step 3: the training loss is nan; .*step-00000002, is kept.*train.learning_rate",
    ):
        run_training(short_run(output_dir), base_model=tiny_llama, datasets=(dataset, dataset))
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == ["step-00000002"]
    assert not (output_dir / "head").exists()
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert [record["step"] for record in records if "loss" in record] == [1, 2]
    assert all(math.isfinite(record["loss"]) for record in read_metrics(output_dir) if "loss" in record)
