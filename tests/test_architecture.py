"""The architecture's rules, enforced: import-linter contracts (pyproject.toml),
and only the CLI prints or exits."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sftpack"
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


def _lint(config: Path, src_root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src_root))
    return subprocess.run(
        [LINT, "--config", str(config), "--no-cache"], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def lint_available():
    if LINT is None:
        pytest.fail("lint-imports is not installed: install sftpack with the 'test' extra")
    return LINT


def test_import_contracts_hold(lint_available):
    proc = _lint(ROOT / "pyproject.toml", ROOT / "src")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_forbidden_import_breaks_a_contract(lint_available, tmp_path):
    """The contracts can fail: the same tree with the handoff importing the trainer path."""
    shutil.copytree(SRC, tmp_path / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    build = tmp_path / "sftpack" / "handoff" / "build.py"
    build.write_text(build.read_text() + "\nfrom ..trainer import pack_step  # a deliberate violation\n")
    proc = _lint(ROOT / "pyproject.toml", tmp_path)
    assert proc.returncode != 0
    assert "The handoff knows no path, no chat and no face BROKEN" in proc.stdout
    assert "sftpack.handoff.build -> sftpack.trainer" in proc.stdout


def test_a_private_import_breaks_the_private_modules_contract(lint_available, tmp_path):
    """The private-module contract can fail: the same tree with the report layout importing
    one of the reader's private modules instead of ``sftpack.chat``."""
    shutil.copytree(SRC, tmp_path / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    layout = tmp_path / "sftpack" / "report" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom ..chat._parts import is_url  # a deliberate violation\n")
    proc = _lint(ROOT / "pyproject.toml", tmp_path)
    assert proc.returncode != 0
    assert "No package imports another package's private modules BROKEN" in proc.stdout
    assert "sftpack.report.layout -> sftpack.chat._parts" in proc.stdout


def _calls_outside_cli() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "cli":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in ("print", "exit", "quit"):
                    found.append(f"{rel}:{node.lineno} calls {f.id}()")
                if isinstance(f, ast.Attribute) and f.attr == "exit" and getattr(f.value, "id", "") == "sys":
                    found.append(f"{rel}:{node.lineno} calls sys.exit()")
            if isinstance(node, ast.Name) and node.id == "SystemExit":
                found.append(f"{rel}:{node.lineno} uses SystemExit")
    return found


def test_only_the_cli_prints_or_exits():
    assert _calls_outside_cli() == []


def test_importing_the_package_or_binpack_loads_no_torch():
    code = (
        "import sys, sftpack, sftpack.binpack; "
        "bad = [m for m in ('torch', 'transformers', 'megatron', 'ray') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("module", ["sftpack.chat", "sftpack.sample", "sftpack.data", "sftpack.testing"])
def test_tokenizing_loads_no_torch(module):
    """The tokenizer side (and every Ray tokenize actor) builds samples without torch (~3 s, ~300 MB)."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was loaded'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_torch_free_sample_is_the_public_one():
    code = (
        "import sys, sftpack, sftpack.sample; "
        "assert sftpack.Sample is sftpack.sample.Sample and 'torch' not in sys.modules; "
        "import sftpack.handoff; "
        "assert sftpack.handoff.Sample is sftpack.Sample and sftpack.PackedBatch is sftpack.handoff.PackedBatch"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
