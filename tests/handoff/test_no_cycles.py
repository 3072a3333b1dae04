"""No import cycle in ``src/sftpack``, type-only imports included.

``tests/test_import_graph.py`` guards the cycles that can break an import at run
time and leaves ``if TYPE_CHECKING:`` imports out. This test is stricter: an
annotation naming a type from a module that imports the annotating one back is a
cycle too (the two modules can then only be understood, type-checked and moved
together), so here every import counts: module level, inside a function, and
under ``if TYPE_CHECKING:``. The handoff's low modules (``slots``, ``layout``,
``media``) type the row they read with a protocol instead of importing
``handoff.batch``.

The graph is read from the source with ``ast``. Relative imports are resolved
against the importing module's package; ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``; an edge to ``a.b.c`` is also
an edge to the packages above it (their ``__init__`` runs), except the root
``sftpack`` and the importer's own packages.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "sftpack"
HANDOFF = f"{PACKAGE}.handoff"


def _modules(src: Path) -> dict[str, Path]:
    found = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _edges(module: str, is_package: bool, source: str, known: set[str]) -> set[str]:
    """Every module of the package that ``module`` imports, at any depth of its ``source``."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names += [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
    out: set[str] = set()
    for name in names:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        while name and name not in known:  # `import sftpack.x.attr`: the longest module prefix
            name = name.rpartition(".")[0]
        parts = name.split(".")
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            if i == len(parts) or not (module + ".").startswith(target + "."):
                out.add(target)
    out.discard(module)
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    mods = _modules(src)
    known = set(mods)
    return {name: _edges(name, path.name == "__init__.py", path.read_text(), known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _shown(found: list[frozenset[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in found:
        edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
        lines.append("{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges))
    return "\n".join(lines)


def _in_handoff(component: frozenset[str]) -> bool:
    return any(m == HANDOFF or m.startswith(HANDOFF + ".") for m in component)


def test_type_only_function_level_and_relative_imports_all_count():
    source = "def f():\n    from .x import y\nif TYPE_CHECKING:\n    from .z import w\nfrom . import v\n"
    known = {"sftpack.a", "sftpack.a.b", "sftpack.a.x", "sftpack.a.z", "sftpack.a.v"}
    assert _edges("sftpack.a.b", False, source, known) == {"sftpack.a.x", "sftpack.a.z", "sftpack.a.v"}
    # an edge to a submodule runs the packages above it, but not the root nor the importer's own
    assert _edges("sftpack.c", False, "from .a.x import y\n", known) == {"sftpack.a", "sftpack.a.x"}


def test_a_planted_type_only_cycle_in_the_handoff_is_found(tmp_path):
    """The check can fail: the tree with ``slots`` naming ``PackedBatch`` for typing only (the
    cycle ``batch`` <-> ``slots`` this package once had)."""
    shutil.copytree(SRC / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    slots = tmp_path / PACKAGE / "handoff" / "slots.py"
    slots.write_text(slots.read_text() + "\n\nif TYPE_CHECKING:\n    from .batch import PackedBatch  # noqa: F401\n")
    found = cycles(import_graph(tmp_path))
    assert frozenset({f"{HANDOFF}.batch", f"{HANDOFF}.slots"}) in found


def test_no_cycle_among_the_handoff_modules():
    graph = import_graph()
    assert {f"{HANDOFF}.batch", f"{HANDOFF}.slots", f"{HANDOFF}.media"} <= set(graph)
    found = [c for c in cycles(graph) if _in_handoff(c)]
    assert not found, "import cycles through sftpack.handoff (type-only imports count):\n" + _shown(found, graph)


def test_no_cycle_anywhere_in_the_package():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in src/sftpack (type-only imports count):\n" + _shown(found, graph)
