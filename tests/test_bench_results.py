"""benchmarks/_results.py, the writer every benchmark uses for benchmarks/RESULTS.md: a run
replaces its own section only, a new script's section is appended, and the tables render."""

from __future__ import annotations

import datetime
import doctest
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results():
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "benchmarks" / "_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_its_examples(results):
    assert doctest.testmod(results).failed == 0


def test_a_run_replaces_its_own_section_only(results, tmp_path):
    path = tmp_path / "RESULTS.md"
    day = datetime.date(2026, 12, 1)
    results.write_section("bench_a.py", "| x |\n|---|\n| 1 |", "machine A", path=path, when=day)
    results.write_section("bench_b.py", "| y |\n|---|\n| 2 |", "machine B", path=path, when=day)
    before = path.read_text()
    assert before.startswith("# Benchmark results") and before.index("bench_a.py") < before.index("bench_b.py")
    results.write_section("bench_a.py", "| x |\n|---|\n| 3 |", "machine C", path=path, when=day)
    after = path.read_text()
    a = after[after.index("<!-- bench_a.py -->") : after.index("<!-- /bench_a.py -->")]
    assert "| 3 |" in a and "machine C" in a and "| 1 |" not in after and "machine A" not in after
    b = "<!-- bench_b.py -->" + before.split("<!-- bench_b.py -->")[1]
    assert after.endswith(b)  # the other section untouched, byte for byte
    assert after.count("<!-- bench_a.py -->") == 1 and "Run on 2026-12-01 (UTC)" in a
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


def test_the_repository_file_has_one_section_per_script(results):
    text = results.RESULTS.read_text()
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        if "write_section" in script.read_text():
            begin = f"<!-- {script.name} -->"
            assert text.count(begin) <= 1 and (begin in text) == (f"<!-- /{script.name} -->" in text), script.name
