"""Every shipped config loads and validates, is named ``<base>_<family>[-<variant>]_<device>.yaml``
and starts with the standard header: its purpose, how to launch it, and an override example
(torchtune's config headers); each command in the header runs this very file and its overrides load."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftheads.config import load_run_config
from draftheads.train.engine import build_deepspeed_config
from draftheads.train.recipe import recipe_for

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YAMLS = sorted(CONFIGS.glob("*.yaml"))
DEEPSPEED = sorted((CONFIGS / "deepspeed").glob("*.json"))
BASES = {
    "smollm2": "smollm2-135m-instruct",
    "gemma3-270m": "gemma3-270m",
    "llama3-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
}
LAUNCH, OVERRIDE = "# To launch", "# Any field can be overridden with dotted key=value pairs"
# The chain that trains the shipped EAGLE-3 head, in order: each step starts from the last one's head.
SHIPPED_EAGLE3_CHAIN = ("greedy", "sampled", "both")


def header_paragraphs(path: Path) -> list[list[str]]:
    """The leading comment block of ``path``, split at its bare ``#`` lines."""
    paragraphs: list[list[str]] = [[]]
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.strip() == "#":
            paragraphs.append([])
        else:
            paragraphs[-1].append(line)
    return paragraphs


def commands(paragraph: list[str]) -> list[list[str]]:
    """The shell commands indented in a header paragraph (``#   cmd``, ``\\`` continues a line), split."""
    joined, pending = [], ""
    for line in paragraph:
        if not line.startswith("#   "):
            continue
        text = pending + line[1:].strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        joined.append(shlex.split(text, comments=True))
        pending = ""
    return joined


def train_overrides(command: list[str], name: str) -> list[str] | None:
    """The key=value overrides of a ``train --config configs/NAME`` command; None for other commands.
    A --config naming another file fails the test: each header runs its own file."""
    if "--config" not in command:
        return None
    config = command[command.index("--config") + 1]
    assert config == f"configs/{name}", f"{name}: a header command runs {config}"
    if "train" not in command:
        return None
    return [token for token in command[command.index("--config") + 2 :] if "=" in token]


def header(path: Path) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """(purpose, launch commands, override commands) of ``path``'s header."""
    paragraphs = header_paragraphs(path)
    assert len(paragraphs) == 3, f"{path.name}: header needs purpose, launch and override paragraphs"
    purpose, launch, override = paragraphs
    assert purpose and not purpose[0].startswith("#   "), f"{path.name}: the header opens with its purpose"
    assert launch[0].startswith(LAUNCH), f"{path.name}: second paragraph starts with '{LAUNCH}'"
    assert override[0].startswith(OVERRIDE), f"{path.name}: third paragraph starts with '{OVERRIDE}'"
    return purpose, commands(launch), commands(override)


def global_batch(train, gpus: int) -> int:
    return train.micro_batch_size * train.gradient_accumulation_steps * gpus


def test_the_shipped_set_is_complete():
    names = {path.name for path in YAMLS}
    for kind in ("medusa", "eagle", "eagle3", "mtp", "dflash"):
        assert f"smollm2_{kind}_cpu.yaml" in names
    for kind in ("medusa", "eagle", "eagle3", "mtp"):
        assert f"llama3-8b_{kind}_8gpu.yaml" in names
    assert "qwen3-8b_eagle3_8gpu.yaml" in names
    for step in SHIPPED_EAGLE3_CHAIN:
        assert f"smollm2_eagle3-corpus-{step}_cpu.yaml" in names
    assert "smollm2_dflash-corpus_cpu.yaml" in names
    assert {path.name for path in DEEPSPEED} >= {f"zero{stage}.json" for stage in range(4)}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_header_launches_this_file_and_its_overrides_load(path):
    _, launch, override = header(path)
    trains = [overrides for c in launch if (overrides := train_overrides(c, path.name)) is not None]
    assert trains, f"{path.name}: the launch paragraph has no `train --config configs/{path.name}`"
    assert launch[-1][:3] != ["cp"], f"{path.name}: the launch paragraph ends with the run"
    examples = [overrides for c in override if (overrides := train_overrides(c, path.name)) is not None]
    assert examples and all(examples), f"{path.name}: the override example sets no key=value"
    for overrides in trains + examples:
        load_run_config(path, overrides)  # each command's overrides name real fields with valid values
    if "_8gpu" in path.name:
        assert all(c[:3] == ["deepspeed", "--num_gpus", "8"] for c in launch if "train" in c)
        # An example on another number of GPUs keeps the global batch (what the run learns).
        expected = global_batch(load_run_config(path).train, 8)
        for command, overrides in zip(override, examples, strict=True):
            gpus = int(command[command.index("--num_gpus") + 1])
            assert global_batch(load_run_config(path, overrides).train, gpus) == expected, command


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_loads_validates_and_its_name_says_base_family_device(path):
    base, family, device = path.stem.split("_")
    run = load_run_config(path)  # the sections check their own values
    assert run.head is not None and family.split("-")[0] == run.head.kind
    assert run.model.base == BASES[base]
    assert device == "cpu" or re.fullmatch(r"[0-9]+gpu", device)
    recipe_for(run.head).check(run)
    dtype = torch.bfloat16 if run.train.precision == "bf16" else torch.float32
    config = build_deepspeed_config(run.train, dtype, world_size=8)
    assert config["train_micro_batch_size_per_gpu"] == run.train.micro_batch_size
    if device == "8gpu":
        assert config["zero_optimization"]["stage"] == 2 and config["bf16"]["enabled"]


def test_the_shipped_eagle3_chain_starts_each_step_from_the_last():
    """Steps 1-6, in the order the headers give them: the first trains from scratch, every later
    one continues the head the step before wrote (no committed head is needed to reproduce it)."""
    previous_output = None
    for step in SHIPPED_EAGLE3_CHAIN:
        path = CONFIGS / f"smollm2_eagle3-corpus-{step}_cpu.yaml"
        _, launch, _ = header(path)
        for command in launch:
            overrides = train_overrides(command, path.name)
            if overrides is None:
                continue
            train = load_run_config(path, overrides).train
            expected = None if previous_output is None else str(Path(previous_output) / "head")
            assert train.init_head == expected, f"{path.name}: {command}"
            previous_output = train.output_dir
    assert previous_output == "runs/eagle3-corpus-both"


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
