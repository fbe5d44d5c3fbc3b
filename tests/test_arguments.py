import argparse

import pytest

from draftheads.arguments import (
    at_least,
    device_name,
    dtype_name,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from draftheads.cli import main


def test_integer_types_accept_their_range_and_name_the_bound():
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and at_least(2)("2") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 0, got -1"):
        non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer, got '2.5'"):
        at_least(2)("2.5")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
        (["distill", "--out", "x.jsonl", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (
            ["generate", "--heads", "h", "--prompt", "p", "--max-new-tokens", "-5"],
            "argument --max-new-tokens: must be >= 1, got -5",
        ),
        (["tune-tree", "--heads", "h", "--max-nodes", "1"], "argument --max-nodes: must be >= 2, got 1"),
        (["tune-tree", "--heads", "h", "--skip", "-1"], "argument --skip: must be >= 0, got -1"),
        (["bench", "--dtype", "fp64"], "argument --dtype: expected auto or one of"),
        (["generate", "--heads", "h", "--prompt", "p", "--device", "gpu0"], "not a torch device: 'gpu0'"),
        (["generate", "--heads", "h", "--prompt", "p", "--temperature", "-1"], "must be >= 0, got -1"),
        (["generate", "--heads", "h", "--prompt", "p", "--top-p", "0"], "must be in (0, 1], got 0"),
        (["bench", "--temperature", "nan"], "argument --temperature: must be >= 0, got nan"),
        (["tune-tree", "--heads", "h", "--dtype", "half"], "argument --dtype: expected auto or one of"),
    ],
)
def test_commands_refuse_bad_numbers_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_float_dtype_and_device_types_accept_what_the_loaders_take():
    assert non_negative_float("0") == 0.0 and probability("1") == 1.0 and probability("0.9") == 0.9
    assert dtype_name("auto") == "auto" and dtype_name("bf16") == "bf16"
    assert device_name("cpu") == "cpu" and device_name("cuda:1") == "cuda:1"  # parsed, not opened
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number, got 'warm'"):
        non_negative_float("warm")
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be in \(0, 1\], got 1.5"):
        probability("1.5")


def test_device_auto_is_every_commands_default_and_names_this_processs_device(monkeypatch):
    import torch

    from draftheads.arguments import device_name
    from draftheads.device import DEFAULT_DEVICE

    assert DEFAULT_DEVICE == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_name("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_name("auto") == "cuda:3"  # a launcher's rank takes its own GPU
    assert device_name("cpu") == "cpu"


def test_every_command_with_a_device_defaults_to_auto():
    import argparse
    import importlib

    from draftheads.cli import COMMANDS

    for name, (module_name, _) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(parser)
        device = next((action for action in parser._actions if "--device" in action.option_strings), None)
        if device is not None:
            assert device.default == "auto", name
