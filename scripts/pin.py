"""Prints the pinned requirement(s) of one optional group of pyproject.toml, the one place pins live."""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
print(" ".join(project["optional-dependencies"][sys.argv[1]]))
