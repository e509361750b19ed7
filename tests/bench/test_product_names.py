"""The product names bench/ imports, frozen: a rename in the product must not turn CI red through a bench test, and a
bench must not grow a hold on the product's insides unnoticed. A new name is meant to be deliberate: regenerate the
snapshot and review its diff with the code.

    EAGLET_UPDATE_BENCH_NAMES=1 pytest tests/bench/test_product_names.py
"""

import ast
import difflib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SNAPSHOT = Path(__file__).with_name("product_names.txt")
REGENERATE = "EAGLET_UPDATE_BENCH_NAMES=1 pytest tests/bench/test_product_names.py"
HEADER = f"# Every eaglet.* name a file under bench/ imports, one a line. Regenerate: {REGENERATE}\n"


def product_names(path: Path) -> set[str]:
    """``eaglet.x.y`` for ``import eaglet.x.y``, ``eaglet.x.name`` for ``from eaglet.x import name``, anywhere in
    the file (imports inside functions included: they run on the GPU machine)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "eaglet"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "eaglet":
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def current() -> str:
    names = set().union(*(product_names(p) for p in sorted(BENCH.rglob("*.py"))))
    return "".join(f"{n}\n" for n in sorted(names))


def test_bench_imports_only_the_frozen_product_names():
    now = current()
    if os.environ.get("EAGLET_UPDATE_BENCH_NAMES") == "1":
        SNAPSHOT.write_text(HEADER + now)
    frozen = "".join(line for line in SNAPSHOT.read_text().splitlines(keepends=True) if not line.startswith("#"))
    if frozen != now:
        diff = "".join(difflib.unified_diff(frozen.splitlines(True), now.splitlines(True), SNAPSHOT.name, "now"))
        pytest.fail(f"the product names bench/ imports changed:\n{diff}\nIf that is meant, regenerate: {REGENERATE}")


def test_bench_edits_no_import_path():
    # bench is a package run from the repository root (python -m bench.<name>); a path edit hides a broken import
    edits = [str(p.relative_to(ROOT)) for p in BENCH.rglob("*.py") if "sys.path" in p.read_text()]
    assert edits == []


def test_no_bench_file_is_over_700_lines():
    # a file past this is runner, harness and phases at once again: split it by phase family
    long = {str(p.relative_to(ROOT)): n for p in BENCH.rglob("*.py") if (n := len(p.read_text().splitlines())) > 700}
    assert long == {}
