"""``sftpack demo --quick`` as a console script: the whole story runs, every check
passes, and ``--report`` writes the PNG report."""

from __future__ import annotations

import subprocess
import sys


def test_demo_quick_runs_as_a_console_script(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sftpack.cli",
            "demo",
            "--quick",
            "--report",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "exact (<= 1e-10; eager <= 2e-05)" in out
    assert "every token and label accounted for: True" in out
    assert "same conversations as padded: True" in out
    assert "losses equal to unpacked (float64, <= 1e-09): True" in out
    for path in ("offline", "loader", "trainer", "none"):
        assert f"\n  {path} " in out  # a line of the summary table
    assert (tmp_path / "sftpack_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
