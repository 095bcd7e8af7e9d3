"""Who may import whom, checked on the source (docs/architecture.md, "Roles and packages").

The core ``tokenpipe`` imports no role; the roles import the core and themselves, never each
other; only the composition root ``tokenpipe_cli`` imports every role; nothing shipped imports
the repository's ``bench`` scripts.
"""

from __future__ import annotations

import ast
import importlib
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = "tokenpipe"
ROLES = ("generator", "relay", "producer")
ROOT_PACKAGE = "tokenpipe_cli"
OURS = {CORE, *ROLES, ROOT_PACKAGE, "bench"}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, lazy imports inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def offenders(package: str, allowed: set[str]) -> dict[str, list[str]]:
    found = {str(p.relative_to(ROOT)): sorted((imported(p) & OURS) - allowed) for p in modules(package)}
    return {module: names for module, names in found.items() if names}


def test_the_core_imports_no_role() -> None:
    assert modules(CORE)
    assert offenders(CORE, {CORE}) == {}


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_only_the_core_and_itself(role: str) -> None:
    assert modules(role)
    assert offenders(role, {CORE, role}) == {}


def test_the_composition_root_imports_the_roles_but_not_the_bench_scripts() -> None:
    assert offenders(ROOT_PACKAGE, OURS - {"bench"}) == {}


def test_the_distribution_ships_the_packages_and_no_bench() -> None:
    """Every package and subpackage is listed: setuptools ships only the ones named."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {".".join(p.parent.relative_to(ROOT).parts) for top in (CORE, *ROLES, ROOT_PACKAGE)
                for p in (ROOT / top).rglob("__init__.py")}
    # Directories of data only (the relay's pages) are listed as packages too, with their files as
    # package data: setuptools warns about data in a directory it is not told is a package.
    data_only = set(project["tool"]["setuptools"]["package-data"]) - packages
    assert sorted(project["tool"]["setuptools"]["packages"]) == sorted(packages | data_only)
    assert all((ROOT / d.replace(".", "/")).is_dir() for d in data_only)
    # The package's main, which starts `tokenpipe up`'s fork server before the command's own imports.
    assert project["project"]["scripts"]["tokenpipe"] == "tokenpipe_cli:main"


@pytest.mark.parametrize("package", [CORE, ROOT_PACKAGE, "producer", "generator"])
def test_no_module_is_named_after_a_standard_library_module(package: str) -> None:
    """``tokenpipe/inspect.py`` shadowed ``inspect`` for any script run from inside the package."""
    assert [p.name for p in modules(package) if p.stem in sys.stdlib_module_names] == []


def test_the_module_map_in_docs_lists_every_module_and_no_other() -> None:
    """docs/architecture.md's module map says what each module owns; it must match the tree."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("- `")}
    present = {str(p.relative_to(ROOT)) for package in (CORE, ROOT_PACKAGE, *ROLES, "bench")
               for p in modules(package) if p.name != "__init__.py"}
    assert not present - listed, f"modules missing from docs/architecture.md's module map: {sorted(present - listed)}"
    assert not listed - present, f"the module map names modules that do not exist: {sorted(listed - present)}"


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"))
def test_bench_script_imports_after_modules_moved(module: str) -> None:
    """Every bench script imports: mypy ignores missing imports, so a module moved by a refactor
    (bench.peers still imported ``tokenpipe.natsserver`` and ``bench.loadgen``) went unseen."""
    importlib.import_module(f"bench.{module}")


# -- the module-level import graph ----------------------------------------------------------
PRODUCT = (CORE, ROOT_PACKAGE, *ROLES)
GENERATOR_LAYERS = ("kernels", "model", "engine", "service")  # bottom first: each imports only those before it


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PRODUCT for p in modules(package)}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``name`` imports, anywhere in it (lazy imports in functions and ``if
    TYPE_CHECKING:`` blocks included): ``from a import b`` counts ``a.b`` where that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    known = product_modules()
    return {name: imports_of(name, path, set(known)) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_product_package_has_an_import_cycle() -> None:
    """A cycle of 13 generator modules (kvcache -> engineproc -> main -> ... -> kvcache) and the CLI's
    cluster <-> natsserver: a module of one could not be understood, tested or moved without the others."""
    graph = import_graph()
    assert any(graph.values())
    assert cycles(graph) == []


def test_the_generator_is_in_layers_each_importing_only_itself_and_those_below() -> None:
    """service -> engine -> model -> kernels (docs/architecture.md, "Module map"); only the role's entry
    point (``generator.main``) and the package's ``__init__`` sit above them."""
    graph = import_graph()
    ours = [m for m in graph if m.startswith("generator.")]
    outside = [m for m in ours if m.split(".")[1] not in GENERATOR_LAYERS and m != "generator.main"]
    assert outside == [], "generator modules outside its layers"
    assert all(f"generator.{layer}" in graph for layer in GENERATOR_LAYERS)
    wrong = {}
    for module in ours:
        if module == "generator.main":
            continue
        allowed = GENERATOR_LAYERS[: GENERATOR_LAYERS.index(module.split(".")[1]) + 1]
        bad = sorted(t for t in graph[module] if t.startswith("generator") and
                     (t == "generator" or t.split(".")[1] not in allowed))
        if bad:
            wrong[module] = bad
    assert wrong == {}


def test_no_product_source_cites_the_benchmark_results_file() -> None:
    """bench/RESULTS.md is a table of today's figures, rewritten as they change; the product's comments
    cited its dated sections ("issue 21, part 14") for their reasons, which then pointed nowhere. A comment
    says its reason itself (docs/perf-history.md keeps the decisions and their figures)."""
    citing = sorted(str(p.relative_to(ROOT)) for package in (CORE, ROOT_PACKAGE, *ROLES)
                    for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix in {".py", ".c", ".cpp", ".h", ".html", ".js", ".css", ".md", ".txt"}
                    and "RESULTS.md" in p.read_text(errors="replace"))
    assert citing == []
