"""The offline package's own layering, read from its source with ``ast`` (function-level
imports included, which import-linter does not see): the two engines never import each
other, the driver imports no engine and no Ray, Ray is imported in one helper only, and
the modules import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import sftpack.offline

ROOT = Path(sftpack.offline.__file__).parent
PACKAGE = "sftpack.offline"
LOCAL = {"sftpack.offline._local"}
RAY = {"sftpack.offline._ray", "sftpack.offline._ray_units", "sftpack.offline._ray_session"}


def _module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement of one file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = PACKAGE.split(".")[: len(PACKAGE.split(".")) - node.level + 1]
                prefix = ".".join(base)
                module = f"{prefix}.{node.module}" if node.module else prefix
            else:
                module = node.module or ""
            found.append((module, id(node) in top))
            if module == PACKAGE:  # ``from . import engine``: the submodules named
                found += [(f"{PACKAGE}.{alias.name}", id(node) in top) for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.glob("*.py")}
    return {
        name: {m for m, _ in _imports(path) if m in modules and m != name and m != PACKAGE}
        for name, path in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a path that returns to its start), or ``[]``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_planted_cycle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(planted) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_offline_function_level_imports_included():
    graph = _graph()
    assert "sftpack.offline._driver" in graph and len(graph) >= 15  # the parser saw the package
    assert _cycle(graph) == []


def test_the_engines_never_import_each_other_and_the_driver_imports_neither():
    graph = _graph()
    for name in LOCAL:
        assert graph[name] & RAY == set(), f"{name} imports the Ray engine"
    for name in RAY:
        assert graph[name] & LOCAL == set(), f"{name} imports the local engine"
    for name in ("sftpack.offline._driver", "sftpack.offline._engine"):
        assert graph[name] & (LOCAL | RAY) == set(), f"{name} imports an engine"
    # both engines implement the interface; only the public facade (and the entry points) name them
    assert "sftpack.offline._engine" in graph["sftpack.offline._local"] & graph["sftpack.offline._ray"]
    assert {m for m in graph if graph[m] & LOCAL} == {"sftpack.offline._prepack", "sftpack.offline.engine"}


def test_ray_is_imported_in_one_helper_and_never_at_module_level():
    where = []
    for path in sorted(ROOT.glob("*.py")):
        for module, at_top in _imports(path):
            if module == "ray" or module.startswith("ray."):
                where.append((path.stem, at_top))
    assert where and all(stem == "_ray_session" and not at_top for stem, at_top in where), where
    driver = {m for m, _ in _imports(ROOT / "_driver.py")}
    assert not any(m == "ray" or m.startswith("ray.") for m in driver)
