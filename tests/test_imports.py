"""Services meet only through the shared core: no module of one service imports another service, and the shared
core imports no service. Tests, the benches and ``cli/`` (the command's dispatch, the local stack, the demo) start
every service, so they are not walked. The job functions the shared queue names as strings are real ones."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet.shared import jobqueue
from tests.conftest import ROOT

SERVICES_DIR, SHARED_DIR = ROOT / "services", ROOT / "shared"  # eaglet.services, eaglet.shared (pyproject.toml)
SERVICES = sorted(p.name for p in SERVICES_DIR.iterdir() if (p / "__init__.py").is_file())


def imported(path: Path, package: str = "") -> set[str]:
    """Every module name ``path`` imports, at its top or inside a function; a relative import is resolved against
    ``package``, the file's own (the shared core imports itself relatively)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module) if part)
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def service_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["eaglet", "services"] and len(parts) > 2 else None


def crossings(folder: Path, package: str, own: str | None) -> list[str]:
    """``file -> module`` for each import in ``folder`` (package ``package``) of a service other than ``own``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        inner = path.relative_to(folder).parent.parts
        for name in sorted(imported(path, ".".join((package, *inner)))):
            other = service_of(name)
            if other is not None and other != own:
                found.append(f"{path.relative_to(ROOT)} -> {name}")
    return found


def test_the_walk_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from eaglet.services.ingest.jobs import ingest_job\n")
    assert service_of(min(n for n in imported(source) if n.startswith("eaglet"))) == "ingest"


def test_the_walk_resolves_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from .keys import RunKeys\nfrom ..services.ingest import jobs\n")
    assert {"eaglet.shared.keys", "eaglet.services.ingest.jobs"} <= imported(source, "eaglet.shared")


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service(service):
    assert crossings(SERVICES_DIR / service, f"eaglet.services.{service}", service) == []


def test_the_shared_core_imports_no_service():
    assert crossings(SHARED_DIR, "eaglet.shared", None) == []


@pytest.mark.parametrize(
    "path",
    [
        jobqueue.EXTRACT_JOB,
        jobqueue.EXTRACT_FAILED,
        jobqueue.INGEST_JOB,
        jobqueue.REGEN_PLAN_JOB,
        jobqueue.REGEN_JOB,
        jobqueue.REGEN_FAILED,
    ],  # fmt: skip
)
def test_every_queued_job_names_a_function(path):
    module, _, name = path.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("module", ["eaglet.services.gateway.main", "eaglet.cli.status"])
def test_status_readers_start_without_torch(module):
    """The gateway and ``eaglet status`` only read Redis: importing torch would cost them seconds at every start (a
    gateway replica, a status check) for nothing."""
    check = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT).returncode == 0, f"{module} imports torch"
