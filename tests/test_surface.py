"""eaglet's outside surface, frozen: every flag of every ``eaglet`` command and of the GPU image's launcher, every
EAGLET_* setting, and every EAGLET_* variable the launcher and the SGLang plugin read.

Scripts, compose files and people's shells use these names; renaming one breaks them without a failing test
anywhere else. A change here is meant to be deliberate: rewrite the snapshot and review its diff with the code.

    EAGLET_UPDATE_SURFACE=1 pytest tests/test_surface.py
"""

import argparse
import difflib
import importlib
import os
import pkgutil
import re
import tomllib
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from eaglet.cli import main as cli
from eaglet.services.inference import sglang_launch
from tests.conftest import ROOT

INFERENCE = Path(sglang_launch.__file__).parent
# The launcher and the plugin run in SGLang's image, outside pydantic's settings: their variables are read by name.
RAW_ENV_READERS = [
    INFERENCE / "sglang_launch.py",
    *sorted((INFERENCE / "sglang_plugin" / "eaglet_sglang").glob("*.py")),
]

SNAPSHOT = Path(__file__).with_name("surface.txt")
REGENERATE = "EAGLET_UPDATE_SURFACE=1 pytest tests/test_surface.py"
HEADER = f"# eaglet's flags and EAGLET_* settings, checked by tests/test_surface.py. Regenerate: {REGENERATE}\n"


class _HelpShown(BaseException):
    """Raised in place of printing a parser's help; a BaseException, so no ``except Exception`` swallows it."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser that answers ``eaglet ARGV --help``: the command runs in-process and stops at its help."""

    def shown(parser: argparse.ArgumentParser, file: object = None) -> None:
        raise _HelpShown(parser)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "print_help", shown)
        try:
            cli.main([*argv, "--help"])
        except _HelpShown as e:
            return e.parser
    raise AssertionError(f"`eaglet {' '.join(argv)} --help` showed no argparse help")


def flags(command: str, parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    return [
        f"eaglet {command} {formatter._format_action_invocation(action)}"
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
    ]


def command_lines(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    top = parser_of([], monkeypatch)
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    lines = []
    for name, sub in commands.choices.items():
        # A command with an entry point parses its own flags; the others are eaglet's own parser's.
        parser = parser_of([name], monkeypatch) if name in cli.ENTRY_POINTS else sub
        lines += flags(name, parser) or [f"eaglet {name}"]
    return lines


def settings_classes() -> set[type[BaseSettings]]:
    """Every Settings class of the package: its modules imported, BaseSettings' subclasses walked."""
    # eaglet is a namespace the editable install answers for, which pkgutil cannot list: each of its folders is.
    for name in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]:
        package = importlib.import_module(name)
        for module in pkgutil.walk_packages(package.__path__, f"{name}."):
            importlib.import_module(module.name)
    found, todo = set(), [BaseSettings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("eaglet."):
                found.add(sub)
            todo.append(sub)
    return found


def launcher_lines() -> list[str]:
    """The GPU image's entry point (``python -m eaglet.services.inference.sglang_launch``): its own flags."""
    parser = sglang_launch.launcher_parser()
    formatter = parser._get_formatter()
    return [
        f"sglang-launch {formatter._format_action_invocation(action)}"
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
    ]


def setting_lines() -> list[str]:
    # The variable names only: moving a field between Settings classes changes no one's environment.
    names = {
        f"{cls.model_config.get('env_prefix', '')}{name}".upper()
        for cls in settings_classes()
        for name in cls.model_fields
    }
    for path in RAW_ENV_READERS:
        names |= set(re.findall(r"\bEAGLET_[A-Z0-9_]+\b", path.read_text()))
    return sorted(name for name in names if name.startswith("EAGLET_"))


def test_the_surface_matches_the_snapshot(monkeypatch):
    current = "\n".join([*command_lines(monkeypatch), *launcher_lines(), *setting_lines()]) + "\n"
    if os.environ.get("EAGLET_UPDATE_SURFACE") == "1":
        SNAPSHOT.write_text(HEADER + current)
        return
    frozen = "".join(line for line in SNAPSHOT.read_text().splitlines(keepends=True) if not line.startswith("#"))
    if current != frozen:
        diff = "".join(difflib.unified_diff(frozen.splitlines(True), current.splitlines(True), "surface.txt", "now"))
        pytest.fail(f"eaglet's flags or settings changed:\n{diff}\nIf that is meant, regenerate: {REGENERATE}")
