"""The package's layers import one way, read from the source (every import, lazy ones included).

A circle, or a low layer reaching up, is how one responsibility ends up with two owners: these rules
keep the startup hook and the launcher environment free of torch, the comm layer free of device
types, and every torch_xla call behind ``xla_runtime``.
"""
import ast
from pathlib import Path
from typing import Dict, Set

import pytest

from tests.conftest import REPO

PACKAGE = "deepspeed_xla"
#: Modules that may import nothing from the package: the startup path, and the bottom layers.
LEAVES = ("bootstrap", "launch_env", "env_vars", "env_file", "xla_runtime", "patches.registry", "devices.cuda.wheels")
#: (importer prefix, imported prefix) pairs that must never be reached, directly or through other modules.
FORBIDDEN = (("devices", "comm"), ("comm", "devices"))
#: Modules only their own package and the command line may import.
TOP = ("report", "bench")
#: Packages whose modules import one another one way: their ``__init__``, which Python runs before any of their
#: modules, imports none of them (else every module of the package is in a circle through it).
ONE_WAY_PACKAGES = ("comm", )


def _module_names() -> Dict[str, Path]:
    names = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


MODULES = _module_names()


def _imports(name: str) -> Set[str]:
    """The package's modules that ``name`` imports, at module level or inside functions."""
    path = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: the package imports absolutely (from {PACKAGE}...)"
            base = node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in MODULES and target != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _reachable(name: str) -> Set[str]:
    seen, todo = set(), list(GRAPH[name])
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(GRAPH[current])
    return seen


def _under(name: str, prefix: str) -> bool:
    full = f"{PACKAGE}.{prefix}"
    return name == full or name.startswith(full + ".")


def test_the_reader_sees_the_package():
    """The rules below would pass on an empty graph: make sure the edges are read."""
    assert f"{PACKAGE}.process_setup" in GRAPH[f"{PACKAGE}.accelerator"]
    assert f"{PACKAGE}.comm.staging" in GRAPH[f"{PACKAGE}.comm.host_staged"]
    assert f"{PACKAGE}.launch_env" in GRAPH[f"{PACKAGE}.registration"]


def test_no_import_circles():
    circles = sorted(name for name in GRAPH if name in _reachable(name))
    assert not circles, f"modules that import themselves through others: {circles}"


@pytest.mark.parametrize("leaf", LEAVES)
def test_bottom_layers_import_nothing_from_the_package(leaf):
    assert not GRAPH[f"{PACKAGE}.{leaf}"], f"{leaf} imports {sorted(GRAPH[f'{PACKAGE}.{leaf}'])}"


@pytest.mark.parametrize("importer, imported", FORBIDDEN, ids=lambda prefix: prefix)
def test_layers_that_never_meet(importer, imported):
    offending = {name: sorted(n for n in _reachable(name) if _under(n, imported))
                 for name in GRAPH if _under(name, importer)}
    assert not any(offending.values()), {k: v for k, v in offending.items() if v}


@pytest.mark.parametrize("top", TOP)
def test_nothing_imports_the_top(top):
    importers = sorted(name for name, imported in GRAPH.items()
                       if not _under(name, top) and any(_under(n, top) for n in imported))
    assert not importers, f"{importers} import {top}"


@pytest.mark.parametrize("package", ONE_WAY_PACKAGES)
def test_the_package_init_imports_none_of_its_modules(package):
    inside = sorted(name for name in GRAPH[f"{PACKAGE}.{package}"] if _under(name, package))
    assert not inside, f"{package}/__init__.py imports {inside}"


def test_torch_xla_is_imported_only_by_xla_runtime():
    importers = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "torch_xla" or m.startswith("torch_xla.") for m in modules):
                importers.append(name)
    assert set(importers) == {f"{PACKAGE}.xla_runtime"}, sorted(set(importers))
