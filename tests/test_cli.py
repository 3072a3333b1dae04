"""The command line: map (text and PNG), demo, help."""

from __future__ import annotations

import subprocess
import sys

from sftpack.cli import main
from sftpack.layout import worked_example


def test_help_lists_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert "map" in out and "demo" in out


def test_map_prints_worked_example(capsys, tmp_path):
    png = tmp_path / "map.png"
    assert main(["map", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 5, 16]" in out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 36]" in out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 20]" in out
    assert "A A A A A . . . |B B B B B B B B B B . ." in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worked_example_rows_validate():
    rows = worked_example()
    assert [r.path for r in rows] == ["offline", "loader", "trainer"]
    for r in rows:
        r.batch.validate()
        assert r.batch.cu_seqlens.tolist() == [0, 5, 15]


def test_demo_runs_as_a_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "sftpack.cli", "demo", "--quick"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exact (<= 1e-5)" in proc.stdout
