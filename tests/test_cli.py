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
