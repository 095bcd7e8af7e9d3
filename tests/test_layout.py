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
    assert project["project"]["scripts"]["tokenpipe"] == "tokenpipe_cli.cli:main"


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


def test_no_product_source_cites_the_benchmark_results_file() -> None:
    """bench/RESULTS.md is a table of today's figures, rewritten as they change; the product's comments
    cited its dated sections ("issue 21, part 14") for their reasons, which then pointed nowhere. A comment
    says its reason itself (docs/perf-history.md keeps the decisions and their figures)."""
    citing = sorted(str(p.relative_to(ROOT)) for package in (CORE, ROOT_PACKAGE, *ROLES)
                    for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.suffix in {".py", ".c", ".cpp", ".h", ".html", ".js", ".css", ".md", ".txt"}
                    and "RESULTS.md" in p.read_text(errors="replace"))
    assert citing == []
