"""Every Python block in the docs runs as pasted.

``>>>`` blocks are doctests (``--doctest-glob=*.md``). The other ```` ```python ```` blocks of a
page run here, top to bottom in one namespace (a page is read in order), in an empty working
directory. A block whose first line is ``# needs: ...`` names what it needs that a CPU test
machine lacks (a GPU, flash-attn, a Megatron model, a Ray cluster); it is compiled, and every
``sftpack`` name it imports is checked to exist.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        if ">>>" not in m.group(1):
            out.append((text[: m.start()].count("\n") + 2, m.group(1)))
    return out


def _sftpack_imports(tree: ast.AST) -> list[tuple[str, str]]:
    return [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sftpack"
        for alias in node.names
    ]


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run_as_pasted(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in _blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        tree = compile(code, where, "exec", flags=ast.PyCF_ONLY_AST)
        for module, name in _sftpack_imports(tree):
            assert not any(part.startswith("_") for part in module.split(".")), f"{where}: private module {module}"
            assert hasattr(importlib.import_module(module), name), f"{where}: {module} has no {name}"
        if code.startswith("# needs:"):
            continue
        exec(compile(tree, where, "exec"), namespace)  # noqa: S102 - the docs' own code
    assert os.getcwd() == str(tmp_path)
