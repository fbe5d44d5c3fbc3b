"""The thin CLI: every listed subcommand builds its parser; unknown commands are refused."""

import argparse
import importlib

import pytest

from draftheads.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_builds_its_parser(name):
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"draftheads {name}")
    module.add_arguments(parser)
    assert callable(module.run)


def test_help_and_unknown_command(capsys):
    assert main([]) == 0
    assert "tune-tree" in capsys.readouterr().out
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_generate_without_a_head_refuses_what_needs_one(capsys):
    from draftheads.cli import main

    assert main(["generate", "--prompt", "hi"]) == 2
    assert "give a head directory (--heads)" in capsys.readouterr().err
    assert main(["generate", "--base", "smollm2-135m-instruct", "--prompt", "hi", "--tree", "cpu-8"]) == 2
    assert "--tree cpu-8 is a head's tree" in capsys.readouterr().err
