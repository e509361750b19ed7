"""What the GPU runs import and the GPU machine lacks.

The GPU machine has its image's packages and what ``stage.sh`` stages, nothing else: a module that eaglet imports at
run time and neither provides stops the run at import. This walks eaglet's modules reachable from the GPU runs'
entry points (``ENTRY_MODULES`` and the SGLang plugin package), following eaglet's own imports transitively, at
module level and inside functions (a lazy import runs too), and collects the third-party modules they import. Each is
mapped to its distribution (this environment's ``importlib.metadata``) and checked against what the machine is given:
the distributions ``stage.sh`` downloads, those the image's package lists in ``results/`` name, and the image's
torch.

    python -m bench.gpu.staging      # from the repo root: prints what is missing, exits 1 if anything is
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The modules the GPU runs start (``python -m ...``, the extractor and ingest workers, the trainer under torchrun,
# the inference server and its release supervisor, SGLang's launch command).
ENTRY_MODULES = (
    "eaglet.services.extractor.worker",
    "eaglet.services.ingest.worker",
    "eaglet.services.trainer.main",
    "eaglet.services.trainer.score",
    "eaglet.services.inference.sglang_launch",
    "eaglet.services.inference.main",
    "eaglet.services.inference.release",
)
# The SGLang plugin: a distribution of its own (top-level package ``eaglet_sglang``) that SGLang loads by its entry
# point inside the server; every module of it counts as an entry.
PLUGIN_DIR = Path("services/inference/sglang_plugin")
PLUGIN_PACKAGE = "eaglet_sglang"

# The SGLang stack stage.sh always stages (step 1), by distribution and by the name it is imported as (this
# environment does not have them installed, so their import names cannot be looked up here).
SGLANG_STACK = {"sglang": "sglang", "sgl_kernel": "sglang-kernel", "flashinfer": "flashinfer-python"}
# The image's own torch (bench/gpu/README.md), the base every staged wheel is chosen against.
IMAGE_BASE = ("torch", "triton")

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
_LISTED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:==|\s+)(\d\S*)$")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, order=True)
class Site:
    """One import statement of a third-party module: its top-level name, the file and the line."""

    module: str
    path: Path
    line: int

    def where(self, base: Path | None = None) -> str:
        path = self.path
        if base is not None and path.is_relative_to(base):
            path = path.relative_to(base)
        return f"{path}:{self.line}"


@dataclass(frozen=True)
class Missing:
    """A distribution the machine is not given, the module that needs it and every place that imports it."""

    distribution: str
    module: str
    sites: tuple[Site, ...]


class Tree:
    """First-party modules: each package root (``eaglet.shared``, ``eaglet_sglang``) and its folder, as a
    package-dir maps them."""

    def __init__(self, roots: Mapping[str, Path]) -> None:
        self.roots = dict(roots)
        self._tops = {r.split(".", 1)[0] for r in self.roots}
        self._strings = re.compile(
            r"^((?:" + "|".join(re.escape(r) for r in sorted(self._tops)) + r")(?:\.\w+)+)(?::\w+)?$"
        )

    def owns(self, name: str) -> bool:
        return name.split(".", 1)[0] in self._tops

    def file(self, name: str) -> Path | None:
        """The source file of a first-party module or package, None if there is none (``eaglet`` itself: a
        namespace, no file)."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            base = self.roots.get(".".join(parts[:n]))
            if base is not None:
                break
        else:
            return None
        stem = base.joinpath(*parts[n:])
        for candidate in (stem.with_suffix(".py"), stem / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def named_in(self, text: str) -> str | None:
        """The first-party module a string names, as RQ job paths and ``-m`` targets do (they run too)."""
        m = self._strings.match(text)
        if m is None:
            return None
        parts = m.group(1).split(".")
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if self.file(name) is not None:
                return name
        return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Every import in one file, at any depth (functions included), but not ``if TYPE_CHECKING:`` bodies."""

    def __init__(self, tree: Tree, module: str, path: Path) -> None:
        self.tree, self.path = tree, path
        self.package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        self.own: set[str] = set()
        self.third: list[Site] = []

    def _add(self, name: str, line: int) -> None:
        if self.tree.owns(name):
            self.own.add(name)
            return
        top = name.split(".", 1)[0]
        if top not in sys.stdlib_module_names and top != "__main__":
            self.third.append(Site(top, self.path, line))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.visit(node.test)
            for stmt in node.body:
                self.visit(stmt)
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".")
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            name = f"{base}.{node.module}" if node.module else base
        else:
            name = node.module or ""
        self._add(name, node.lineno)
        if self.tree.owns(name):  # ``from pkg import mod`` imports pkg.mod when it is a module
            for alias in node.names:
                if alias.name != "*" and self.tree.file(f"{name}.{alias.name}") is not None:
                    self.own.add(f"{name}.{alias.name}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            named = self.tree.named_in(node.value)
            if named is not None:
                self.own.add(named)


def third_party_imports(entries: Iterable[str], tree: Tree) -> list[Site]:
    """The third-party imports of every first-party module reachable from ``entries``, sorted."""
    seen: set[str] = set()
    todo = list(entries)
    sites: list[Site] = []
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for n in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            prefix = ".".join(parts[:n])
            if prefix in seen:
                continue
            seen.add(prefix)
            path = tree.file(prefix)
            if path is None:
                continue
            visitor = _Imports(tree, prefix, path)
            visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            sites.extend(visitor.third)
            todo.extend(sorted(visitor.own - seen))
    return sorted(set(sites))


def package_folders(repo: Path = REPO) -> dict[str, Path]:
    """eaglet's package roots and their folders in ``repo``, as pyproject.toml maps them onto eaglet.*."""
    mapped = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    return {name: repo / folder for name, folder in mapped.items()}


def gpu_entries(repo: Path = REPO) -> tuple[list[str], Tree]:
    """The GPU runs' entry modules that exist in ``repo`` (the plugin's modules included) and their tree."""
    tree = Tree({**package_folders(repo), PLUGIN_PACKAGE: repo / PLUGIN_DIR / PLUGIN_PACKAGE})
    entries = [m for m in ENTRY_MODULES if tree.file(m) is not None]
    plugin = repo / PLUGIN_DIR / PLUGIN_PACKAGE
    for path in sorted(plugin.rglob("*.py")):
        rel = path.relative_to(repo / PLUGIN_DIR).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        entries.append(".".join(parts))
    return entries, tree


def stage_distributions(stage_sh: Path) -> set[str]:
    """The distributions stage.sh downloads: the ``name==version`` words of its ``dl`` lines and of ``DEPS``."""
    text = stage_sh.read_text(encoding="utf-8").replace("\\\n", " ")
    words: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("dl "):
            words += stripped.split()
    for m in re.finditer(r'^\s*DEPS="([^"]*)"', text, re.MULTILINE):
        words += m.group(1).split()
    pins = (_PIN.match(w.strip("'\"")) for w in words)
    return {normalize(m.group(1)) for m in pins if m is not None}


def listed_distributions(paths: Iterable[Path]) -> set[str]:
    """The distributions package lists name (``name version`` or ``name==version`` lines; others are ignored)."""
    names: set[str] = set()
    for path in paths:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            m = _LISTED.match(line.strip())
            if m is not None:
                names.add(normalize(m.group(1)))
    return names


def provided_distributions(repo: Path = REPO) -> set[str]:
    """What the GPU machine has: stage.sh's downloads, SGLang's stack, the image's lists and its torch."""
    results = repo / "results"
    lists = sorted({*results.glob("gpu-machine-*.txt"), *results.glob("gpu-machine-packages*.txt")})
    return (
        stage_distributions(repo / "bench" / "gpu" / "stage.sh")
        | {normalize(d) for d in SGLANG_STACK.values()}
        | listed_distributions(lists)
        | {normalize(d) for d in IMAGE_BASE}
    )


def distributions_of(module: str, installed: Mapping[str, list[str]]) -> list[str]:
    """The distributions that may provide a top-level module, by this environment's metadata, else its own name."""
    if module in SGLANG_STACK:
        return [normalize(SGLANG_STACK[module])]
    return sorted({normalize(d) for d in installed.get(module, [])}) or [normalize(module)]


def find_missing(
    sites: Iterable[Site], provided: set[str], installed: Mapping[str, list[str]] | None = None
) -> list[Missing]:
    """The modules none of whose distributions is provided, each with every place that imports it."""
    installed = importlib.metadata.packages_distributions() if installed is None else installed
    by_module: dict[str, list[Site]] = {}
    for site in sites:
        by_module.setdefault(site.module, []).append(site)
    missing = []
    for module, where in sorted(by_module.items()):
        dists = distributions_of(module, installed)
        if not provided.intersection(dists):
            missing.append(Missing(dists[0], module, tuple(sorted(where))))
    return missing


def check(repo: Path = REPO) -> list[Missing]:
    """What the GPU runs import that the machine lacks."""
    entries, tree = gpu_entries(repo)
    return find_missing(third_party_imports(entries, tree), provided_distributions(repo))


def report(missing: Iterable[Missing], base: Path | None = REPO) -> str:
    """One line per missing module and the places that import it."""
    return "\n".join(
        f"{m.module} (distribution {m.distribution}): imported at " + ", ".join(s.where(base) for s in m.sites)
        for m in missing
    )


def main() -> int:
    missing = check()
    if missing:
        print("not staged and not in the image:\n" + report(missing))
        return 1
    print("every third-party module the GPU runs import is staged or in the image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
