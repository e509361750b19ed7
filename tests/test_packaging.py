"""The design's top-level folders are eaglet's packages: pyproject.toml maps each onto its name under eaglet.* and
lists every package in them (one left out would be missing from the wheel, though the editable install finds it),
and the images put each folder where its name says. Read statically: no build, no Docker."""

import re
import tomllib
from pathlib import Path

from tests.conftest import ROOT

SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = SETUPTOOLS["package-dir"]  # eaglet.cli -> cli, ...


def package_folders() -> set[str]:
    """The package name of every folder under the mapped ones reached through folders with an ``__init__.py``, as
    Python imports them (the SGLang plugin's, below a folder without one, is a distribution of its own)."""
    names = set()
    for name, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            inner = init.parent.relative_to(ROOT / folder).parts
            if all((ROOT / folder).joinpath(*inner[:n], "__init__.py").is_file() for n in range(len(inner))):
                names.add(".".join((name, *inner)))
    return names


def folder_of(package: str) -> Path:
    root = max((name for name in FOLDERS if package == name or package.startswith(f"{name}.")), key=len)
    return ROOT / FOLDERS[root] / Path(*package.removeprefix(root).split(".")[1:])


def test_every_package_folder_is_listed_and_every_listed_package_is_a_folder():
    listed = set(SETUPTOOLS["packages"])
    assert package_folders() <= listed
    # the others hold files the code reads (the live page's), no Python
    for package in listed - package_folders():
        assert folder_of(package).is_dir() and not list(folder_of(package).glob("*.py")), package
        assert SETUPTOOLS["package-data"][package] == ["*"]


def test_no_top_level_folder_shadows_the_installed_namespace():
    # A folder named eaglet at the top would be found first by any process with the repository on its path (the
    # tests' subprocesses, the benches, the GPU runs), and eaglet.services looked for inside it.
    assert not (ROOT / "eaglet").exists()
    assert {name.split(".")[0] for name in SETUPTOOLS["packages"]} == {"eaglet"}


def test_the_image_puts_each_folder_where_its_package_name_says():
    copies = re.findall(r"^COPY (\S+) (\S+)$", (ROOT / "docker" / "Dockerfile").read_text(), re.MULTILINE)
    expected = {(f"{folder}/", "/app/" + name.replace(".", "/") + "/") for name, folder in FOLDERS.items()}
    assert expected <= set(copies)


def test_the_gpu_image_builds_the_wheel_from_every_folder():
    copies = re.findall(r"^COPY (\S+) (\S+)$", (ROOT / "services" / "inference" / "Dockerfile.sglang").read_text(),
                        re.MULTILINE)  # fmt: skip
    assert {(f"{folder}/", f"./{folder}/") for folder in FOLDERS.values()} <= set(copies)
