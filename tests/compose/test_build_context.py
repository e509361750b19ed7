"""Every file a Dockerfile copies is in the build context that .dockerignore leaves; read statically (no Docker).

A COPY of a path .dockerignore keeps out fails only when the image builds, which CI never does."""

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted({*ROOT.joinpath("docker").glob("*Dockerfile*"), *ROOT.joinpath("services").rglob("Dockerfile*")})


def ignore_rules() -> list[tuple[re.Pattern, bool]]:
    """.dockerignore's patterns in order, each with whether it keeps a path out (a `!` pattern lets it back in)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = "".join(
            "(.*/)?" if part == "**/" else ".*" if part == "**" else "[^/]*" if part == "*" else re.escape(part)
            for part in re.split(r"(\*\*/|\*\*|\*)", pattern)
        )
        rules.append((re.compile(regex), exclude))
    return rules


RULES = ignore_rules()


def in_context(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path, or a folder above it, decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    decided = False
    for regex, exclude in RULES:
        if any(regex.fullmatch(p) for p in prefixes):
            decided = exclude
    return not decided


def copy_sources(dockerfile: Path) -> list[str]:
    """The sources of every COPY and ADD that reads the build context (not another stage)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources = []
    for line in text.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() not in ("COPY", "ADD"):
            continue
        args = rest.split()
        if any(a.startswith("--from=") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        if args and args[0].startswith("["):
            args = json.loads(" ".join(args))
        sources += args[:-1]
    return sources


def test_the_matcher_reads_dockerignore_as_docker_does():
    assert in_context("shared/ids.py") and in_context("pyproject.toml") and in_context("scripts/pin.py")
    assert not in_context("shared/__pycache__/ids.cpython-311.pyc")
    assert not in_context("var/models/x") and not in_context("scripts/install-system.sh")
    assert in_context("data/demo/train.jsonl") and not in_context("data/demo/notes.md")


def test_every_image_builds_from_the_repository_root():
    # The one .dockerignore applies to a build only when the build context is the repository root.
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    builds = {s["build"]["dockerfile"]: s["build"]["context"] for s in compose["services"].values() if "build" in s}
    assert set(builds.values()) == {"."}
    assert {ROOT / d for d in builds} == set(DOCKERFILES)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_copy_source_is_in_the_build_context(dockerfile):
    sources = copy_sources(dockerfile)
    assert sources, "no COPY found: the parser no longer reads this Dockerfile"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"{source} does not exist"
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        kept = [f for f in files if in_context(str(f.relative_to(ROOT)))]
        assert kept, f"{dockerfile.name} copies {source}, which .dockerignore keeps out of the build context"
