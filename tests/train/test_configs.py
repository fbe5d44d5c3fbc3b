"""Every shipped config loads and validates; each YAML says how to run it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftheads.config import load_run_config
from draftheads.train.loop import build_deepspeed_config
from draftheads.train.recipe import recipe_for

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YAMLS = sorted(CONFIGS.glob("*.yaml"))
DEEPSPEED = sorted((CONFIGS / "deepspeed").glob("*.json"))


def test_the_shipped_set_is_complete():
    names = {path.name for path in YAMLS}
    for kind in ("medusa", "eagle", "eagle3", "mtp"):
        assert f"{kind}-smollm2.yaml" in names
        assert f"{kind}-llama3-8b-8gpu.yaml" in names
    assert {path.name for path in DEEPSPEED} >= {f"zero{stage}.json" for stage in range(4)}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_loads_validates_and_starts_with_its_command(path):
    first_line = path.read_text().splitlines()[0]
    assert (
        first_line.startswith("# ")
        and "draftheads" in first_line
        and f"--config configs/{path.name}" in first_line
    )
    run = load_run_config(path)  # the sections check their own values
    assert run.head is not None and path.name.startswith(run.head.kind + "-")
    recipe_for(run.head).check(run)
    dtype = torch.bfloat16 if run.train.precision == "bf16" else torch.float32
    config = build_deepspeed_config(run.train, dtype, world_size=8)
    assert config["train_micro_batch_size_per_gpu"] == run.train.micro_batch_size
    if "8gpu" in path.name:
        assert first_line.startswith("# deepspeed --num_gpus 8 $(which draftheads) train")
        assert config["zero_optimization"]["stage"] == 2 and config["bf16"]["enabled"]


@pytest.mark.parametrize("path", DEEPSPEED, ids=lambda p: p.name)
def test_deepspeed_json_parses_and_names_its_stage(path):
    config = json.loads(path.read_text())
    assert config["zero_optimization"]["stage"] == int(path.stem.removeprefix("zero"))


def test_heads_and_infer_do_not_import_training():
    code = (
        "import sys, draftheads.heads, draftheads.infer\n"
        "bad = [m for m in ('deepspeed', 'wandb', 'datasets', 'draftheads.train') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
