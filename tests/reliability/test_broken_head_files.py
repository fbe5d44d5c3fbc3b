"""A head directory whose files were damaged or hand-edited (config.json, tree.json, bench.json) is
refused with HeadFormatError naming the file, the field and the value, so that the command line
shows one line instead of a traceback labelled as a bug."""

from __future__ import annotations

import json

import pytest
import torch

from draftheads.cli import main
from draftheads.export import export_head
from draftheads.export.model_card import read_bench
from draftheads.heads import build_head, load_head, load_head_and_base, resolve_base_model
from draftheads.heads.base import HeadFormatError
from draftheads.heads.medusa import MedusaConfig
from draftheads.infer.tree import TUNED_TREE_FORMAT, load_tuned_tree, tuned_tree_key
from draftheads.infer.verify_cost import load_tuned_costs
from draftheads.machine import machine_info

pytestmark = pytest.mark.usefixtures("single_thread")

SETTING = tuned_tree_key(torch.float32, "cpu")


@pytest.fixture
def head_dir(tiny_llama, tmp_path):
    head = build_head(tiny_llama, MedusaConfig(num_heads=2, num_layers=1), base_name="tiny-llama")
    return head.save_pretrained(tmp_path / "head")


def edited(config: dict, **fields) -> dict:
    """``config`` with top-level ``fields`` replaced; ``base_config__x`` replaces ``base_config.x``
    (None deletes it)."""
    config = json.loads(json.dumps(config))
    for name, value in fields.items():
        target, key = (config["base_config"], name.split("__")[1]) if "__" in name else (config, name)
        if value is None:
            del target[key]
        else:
            target[key] = value
    return config


# (what the hand edit does to config.json, expected parts of the message after "<path>: ")
BROKEN_CONFIGS = {
    "not JSON": (lambda config: "{not json", ["not valid JSON ("]),
    "a list": (lambda config: "[]", ["expected a JSON object, got a list"]),
    "unknown head kind": (
        lambda config: json.dumps(edited(config, head_kind="eagle4")),
        ["field 'head_kind'", "'eagle4'", "known kinds: dflash, eagle, eagle3, medusa, mtp"],
    ),
    "no model_type": (
        lambda config: json.dumps(edited(config, base_config__model_type=None)),
        ["missing field 'base_config.model_type'"],
    ),
    "unknown model_type": (
        lambda config: json.dumps(edited(config, base_config__model_type="lama")),
        ["field 'base_config.model_type'", "unknown model type 'lama'"],
    ),
    "base_model a string": (
        lambda config: json.dumps(edited(config, base_model="tiny-llama")),
        ["field 'base_model' must be a JSON object, got a string 'tiny-llama'"],
    ),
    "base_config a value its class refuses": (  # transformers 5 configs validate their fields
        lambda config: json.dumps(edited(config, base_config__hidden_size="64")),
        ["field 'base_config': ", "hidden_size"],
    ),
    "base_config a list": (
        lambda config: json.dumps(edited(config, base_config=["llama"])),
        ["field 'base_config' must be a JSON object, got a list ['llama']"],
    ),
}


def break_config(head_dir, case: str):
    config_path = head_dir / "config.json"
    damage, expected = BROKEN_CONFIGS[case]
    config_path.write_text(damage(json.loads(config_path.read_text())))
    return config_path, expected


def assert_names(err: pytest.ExceptionInfo, path, expected: list[str]) -> None:
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_a_broken_config_is_named_by_load_head_and_export(case, head_dir, tmp_path):
    config_path, expected = break_config(head_dir, case)
    with pytest.raises(HeadFormatError) as caught:
        load_head(head_dir)
    assert_names(caught, config_path, expected)
    with pytest.raises(HeadFormatError) as caught:
        export_head(head_dir, tmp_path / "out", "draftheads")
    assert_names(caught, config_path, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["a list", "unknown head kind", "base_model a string"])
def test_a_broken_config_is_named_where_generate_and_tune_tree_read_it(case, head_dir, tiny_llama):
    config_path, expected = break_config(head_dir, case)
    with pytest.raises(HeadFormatError) as caught:
        load_head_and_base(head_dir, tiny_llama)
    assert_names(caught, config_path, expected)


def test_resolve_base_model_refuses_a_base_model_that_is_not_an_object(head_dir):
    config_path, expected = break_config(head_dir, "base_model a string")
    with pytest.raises(HeadFormatError) as caught:
        resolve_base_model(head_dir)
    assert_names(caught, config_path, expected)


def test_weights_that_do_not_fit_the_recorded_base_config_are_named(head_dir):
    config_path = head_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(edited(config, base_config__hidden_size=32)))
    with pytest.raises(HeadFormatError) as caught:
        load_head(head_dir)
    assert_names(
        caught, head_dir / "model.safetensors", [f"the head {config_path} describes", "size mismatch"]
    )


def test_export_refuses_a_training_block_that_is_not_an_object(head_dir, tmp_path):
    config_path = head_dir / "config.json"
    config_path.write_text(json.dumps(edited(json.loads(config_path.read_text()), training=[1, 2])))
    with pytest.raises(HeadFormatError) as caught:
        export_head(head_dir, tmp_path / "out", "draftheads")
    assert_names(caught, config_path, ["field 'training' must be a JSON object, got a list [1, 2]"])


def test_export_of_a_config_that_is_a_list_is_one_line_on_the_command_line(head_dir, tmp_path, capsys):
    config_path, _ = break_config(head_dir, "a list")
    assert main(["export", "--heads", str(head_dir), "--out", str(tmp_path / "out")]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    assert err == f"draftheads export: {config_path}: expected a JSON object, got a list\n"
    assert not (tmp_path / "out").exists()


# ---- tree.json (draftheads tune-tree) ----------------------------------------------------------


def tuned(trees) -> str:
    return json.dumps({"format": TUNED_TREE_FORMAT, "trees": trees})


CURVE = {"sizes": [1, 4], "seconds": [0.1, 0.12]}
READERS = {"tree": load_tuned_tree, "costs": load_tuned_costs}
# (tree.json text or a function giving it, expected parts of the message after "<path>: ", the
# readers that read the broken part: load_tuned_tree reads the tree, load_tuned_costs the curves)
BROKEN_TREE_FILES = {
    "not JSON": ("{", ["invalid JSON: "], ("tree", "costs")),
    "a list": ("[]", [f"'format' must be '{TUNED_TREE_FORMAT}'"], ("tree", "costs")),
    "trees a list": (tuned([]), ["'trees' must be a JSON object", "got []"], ("tree", "costs")),
    "entry a list": (
        tuned({SETTING: []}),
        [f"'trees.{SETTING}' must be a JSON object, got []"],
        ("tree", "costs"),
    ),
    "tree a list": (
        tuned({SETTING: {"tree": [[0]]}}),
        [f"trees.{SETTING}.tree: 'type' must be 'static' or 'dynamic', got [[0]]"],
        ("tree",),
    ),
    "verify_costs a list": (
        tuned({SETTING: {"tree": {"type": "static", "choices": [[0]]}, "verify_costs": [CURVE]}}),
        [f"trees.{SETTING}.verify_costs: must be a JSON object"],
        ("costs",),
    ),
    "curve without seconds": (
        lambda: tuned(
            {
                SETTING: {
                    "tree": {"type": "static", "choices": [[0]]},
                    # this machine at the test's thread count, so that the curves are read
                    "machine": machine_info(torch.float32, "cpu"),
                    "verify_costs": {"1": {"sizes": [1, 4]}},
                }
            }
        ),
        [f"trees.{SETTING}.verify_costs.1: KeyError('seconds')"],
        ("costs",),
    ),
}


@pytest.mark.parametrize("case", BROKEN_TREE_FILES)
def test_a_broken_tree_file_is_named(case, head_dir):
    """load_tuned_tree is what SpeculativeGenerator.from_pretrained, bench and the demo read;
    load_tuned_costs what adaptive drafting reads."""
    text, expected, failing = BROKEN_TREE_FILES[case]
    path = head_dir / "tree.json"
    path.write_text(text() if callable(text) else text)
    for name, reader in READERS.items():
        if name in failing:
            with pytest.raises(HeadFormatError) as caught:
                reader(head_dir, torch.float32, "cpu")
            assert_names(caught, path, expected)
        else:
            reader(head_dir, torch.float32, "cpu")  # the part it reads is sound


# ---- bench.json (draftheads bench), copied and summarised by export -----------------------------

BROKEN_BENCH_FILES = {
    "not JSON": ("{", ["not valid JSON ("]),
    "a list": ("[]", ["expected a JSON object, got a list"]),
    "summaries an object": (
        json.dumps({"summaries": {}}),
        ["field 'summaries' must be a list, got an object"],
    ),
    "summary without method": (
        json.dumps({"summaries": [{"category": "all"}]}),
        ["field 'summaries[0]' must be an object with a 'method'"],
    ),
}


@pytest.mark.parametrize("case", BROKEN_BENCH_FILES)
def test_a_broken_bench_file_is_named(case, head_dir, tmp_path):
    text, expected = BROKEN_BENCH_FILES[case]
    path = head_dir / "bench.json"
    path.write_text(text)
    with pytest.raises(HeadFormatError) as caught:
        read_bench(head_dir)
    assert_names(caught, path, expected)
    with pytest.raises(HeadFormatError) as caught:
        export_head(head_dir, tmp_path / "out", "draftheads")
    assert_names(caught, path, expected)
    assert not (tmp_path / "out").exists()


def test_tune_tree_refuses_a_broken_tree_file_before_it_tunes(head_dir, capsys, monkeypatch):
    """tune-tree merges its result into tree.json: a broken one is refused before the base loads,
    not after minutes of measuring."""
    import draftheads.base_model

    def no_loading(*args, **kwargs):
        raise AssertionError("the base model was loaded before tree.json was checked")

    monkeypatch.setattr(draftheads.base_model, "load_base", no_loading)
    (head_dir / "tree.json").write_text("[]")
    assert main(["tune-tree", "--heads", str(head_dir), "--dtype", "float32"]) == 4
    assert f"{head_dir / 'tree.json'}: 'format' must be" in capsys.readouterr().err
