"""The packages stay layered (docs/architecture.md, "Layers"): every import, at module level or
inside a function, points to a lower layer or stays in its own package, no two files import each
other even indirectly, and the pure layers import nothing heavy. Read from the source with
``ast``: nothing is imported, so a lazy import cannot hide an arrow."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO

#: Bottom up. A package may import packages of lower layers only; packages of one layer do not
#: import each other.
LAYERS: dict[str, int] = {
    "policies": 0,  # pure decisions
    "jobspec": 1,  # the job schema, wire types, import targets, durable files
    "workers": 2,  # the worker actor
    "ringleader_examples": 2,  # recipes the workers build (import targets)
    "orchestrator": 3,  # the driver
    "simulator": 4,  # the policies at scale, in simulated time
    "benchmarks": 4,  # ringleader against its contenders
    "ringleader": 5,  # the public API and the CLI
}

#: What the pure layers may import beyond the standard library and the layers beneath them.
ALLOWED_THIRD_PARTY = {
    "policies": {"numpy"},
    "jobspec": {"pydantic", "pydantic_core", "typing_extensions", "numpy"},
}


def _shipped_packages() -> list[str]:
    """The top-level packages ``pyproject.toml`` ships (its list also names their subpackages)."""
    return [name for name in _shipped() if "." not in name]


def _shipped() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def _modules() -> dict[str, Path]:
    modules = {}
    for package in _shipped_packages():
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names ``node`` imports (a ``from`` import's names when they are modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _imports() -> dict[str, set[str]]:
    """Every module's imports: project modules by their own name, others by top-level name."""
    found: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, node):
                    while name and name not in MODULES and name.split(".")[0] in LAYERS:
                        name = name.rpartition(".")[0]
                    if name:
                        found[module].add(name if name in MODULES else name.split(".")[0])
    return found


IMPORTS = _imports()


def test_every_shipped_package_has_a_layer():
    assert set(_shipped_packages()) == set(LAYERS)


def test_every_subpackage_is_shipped():
    # setuptools installs only the packages listed: a subpackage left out works in the
    # checkout and is missing from a wheel.
    folders = {".".join(init.parent.relative_to(ROOT).parts) for package in _shipped_packages()
               for init in (ROOT / package).rglob("__init__.py")}
    assert folders == set(_shipped())


def upward_imports(imports: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a package at the same layer or above ``a``'s."""
    found = []
    for module, targets in sorted(imports.items()):
        package = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other in LAYERS and other != package and LAYERS[other] >= LAYERS[package]:
                found.append(f"{module} -> {target}")
    return found


def test_imports_point_down_the_layers():
    assert upward_imports(IMPORTS) == []


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
            elif child in MODULES and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(imports.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def test_no_two_modules_import_each_other():
    # A package's __init__ importing its own modules is not an arrow back: leave those edges out.
    edges = {m: {t for t in ts if t in MODULES and not m.startswith(t + ".")} for m, ts in IMPORTS.items()}
    assert import_cycles(edges) == []


@pytest.mark.parametrize("package", sorted(ALLOWED_THIRD_PARTY))
def test_pure_layers_import_only_the_standard_library(package):
    allowed = ALLOWED_THIRD_PARTY[package] | set(sys.stdlib_module_names) | {"__future__"}
    heavy = sorted(
        f"{module} -> {target}"
        for module, targets in IMPORTS.items() if module.split(".")[0] == package
        for target in targets if target.split(".")[0] not in allowed and target.split(".")[0] not in LAYERS
    )
    assert heavy == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    # The checks themselves, on made-up arrows between real modules: a policy reaching into
    # the worker, a package importing its neighbour in the same layer, two driver modules
    # importing each other through a third.
    upward = {"policies.split": {"workers.comm.ring", "policies.ewma"}, "simulator.engine": {"benchmarks.workloads"}}
    assert upward_imports(upward) == ["policies.split -> workers.comm.ring", "simulator.engine -> benchmarks.workloads"]
    loop = {"orchestrator.launch": {"orchestrator.accounting.summary"}, "orchestrator.accounting.summary": {"orchestrator.commands.report"},
            "orchestrator.commands.report": {"orchestrator.launch", "jobspec.job"}}
    assert import_cycles(loop) == [["orchestrator.accounting.summary", "orchestrator.commands.report", "orchestrator.launch"]]


def _rooms(package: str) -> dict[str, int]:
    """Each room of ``package`` (a subpackage, or a module at its top) and its level, from the
    table in docs/architecture.md ("Inside the worker and the driver")."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split(f"<!-- rooms {package} -->", 1)[1].split("<!-- /rooms -->", 1)[0]
    rooms = {}
    for level, name in re.findall(r"^\| (\d+) \| `([\w.]+)/?` \|", table, re.M):
        assert name.removesuffix(".py") not in rooms, f"{name} is listed twice"
        rooms[name.removesuffix(".py")] = int(level)
    return rooms


def _room(module: str) -> str:
    """The room of ``workers.comm.ring`` is ``comm``; of ``workers.actor``, ``actor``."""
    return module.split(".")[1]


def room_violations(package: str, imports: dict[str, set[str]], rooms: dict[str, int]) -> list[str]:
    """``a -> b`` for each import from a room of ``package`` to another room at its level or above."""
    found = []
    for module, targets in sorted(imports.items()):
        if module.split(".")[0] != package or module == package:
            continue
        for target in sorted(targets):
            if target.split(".")[0] != package or target == package or _room(target) == _room(module):
                continue
            if rooms[_room(target)] >= rooms[_room(module)]:
                found.append(f"{module} -> {target}")
    return found


@pytest.mark.parametrize("package", ["workers", "orchestrator"])
def test_every_room_is_in_the_table(package):
    present = {_room(m) for m in MODULES if m.split(".")[0] == package and m != package}
    assert set(_rooms(package)) == present


@pytest.mark.parametrize("package", ["workers", "orchestrator"])
def test_imports_point_down_the_rooms(package):
    assert room_violations(package, IMPORTS, _rooms(package)) == []


def test_the_room_check_catches_an_import_beside_and_above():
    rooms = _rooms("workers")
    imports = {"workers.comm.ring": {"workers.optim.fused", "workers.runtime.devices"},
               "workers.data.sampler": {"workers.step.claims"}, "workers.step.census": {"workers.step.records"}}
    assert room_violations("workers", imports, rooms) == [
        "workers.comm.ring -> workers.optim.fused", "workers.data.sampler -> workers.step.claims"]


#: The packages whose every module must be tested by name (docs/architecture.md, "Where it is tested").
MIRRORED = ("workers", "orchestrator", "policies", "jobspec")


def _tested_names() -> tuple[set[str], set[str]]:
    """The module names of the test files (``test_sampler.py``: ``sampler``) and every module a
    test file imports, by its dotted name."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    imported: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
    return {path.stem.removeprefix("test_") for path in files}, imported


def untested(modules: list[str], named: set[str], imported: set[str]) -> list[str]:
    """The modules no test file imports and none is named after: a name counts only for a
    module whose last part no other module shares (``report`` is two modules' name: a
    ``test_report.py`` speaks for neither)."""
    leaves = [m.rpartition(".")[2] for m in modules]
    return [
        m for m, leaf in zip(modules, leaves)
        if m not in imported and (leaf not in named or leaves.count(leaf) > 1)
    ]


def test_every_module_has_its_test_file_or_a_test_that_imports_it():
    modules = sorted(m for m, path in MODULES.items() if m.split(".")[0] in MIRRORED and path.name != "__init__.py")
    assert untested(modules, *_tested_names()) == []


def test_the_mirror_check_catches_a_module_no_test_names():
    named, imported = {"sampler", "report"}, {"workers.step.claims", "orchestrator.commands.report"}
    modules = ["workers.data.sampler", "workers.step.claims", "workers.step.census", "workers.step.report",
               "orchestrator.commands.report"]
    assert untested(modules, named, imported) == ["workers.step.census", "workers.step.report"]
