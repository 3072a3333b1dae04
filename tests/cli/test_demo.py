"""``sftpack demo --quick --report DIR`` as a console script: it exits 0, and the
results it writes beside the PNG (``sftpack_demo.json``, the :class:`DemoDone` of
:func:`sftpack.report.demo.run_demo`) hold every check, passed, and each path's numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sftpack.cli import main
from sftpack.report.demo import EAGER_64, EXACT_64, EXACT_MM_64, TRAIN_64, run_demo

PACKED = ("offline", "loader", "trainer")
CHECKS = {
    *(f"{p}: accounted" for p in PACKED),
    "exact: real+padded",
    "exact: padded-for-both",
    "exact: consumers",
    "trainer: same conversations as padded",
    *(f"{p}: losses equal" for p in PACKED),
    "multimodal: accounted",
    "multimodal: patch budget held",
    "multimodal: exact real+padded",
    "multimodal: exact padded-for-both",
}


def test_demo_quick_runs_as_a_console_script_and_writes_its_results(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sftpack.cli", "demo", "--quick", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert (tmp_path / "sftpack_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "sftpack_demo.json").read_text())

    assert set(results["checks"]) == CHECKS  # every check ran (none renamed or dropped) ...
    assert [name for name, passed in results["checks"].items() if not passed] == []  # ... and passed
    assert results["ok"] is True
    assert results["tolerances"] == {
        "exact_64": EXACT_64,
        "eager_64": EAGER_64,
        "train_64": TRAIN_64,
        "exact_multimodal_64": EXACT_MM_64,
    }

    paths = results["paths"]
    assert set(paths) == {*PACKED, "none"}
    steps = len(paths["none"]["losses"])  # the same number of steps for every path
    assert steps > 0
    for name, p in paths.items():
        assert p["rows"] > 0 and 0 < p["fill"] <= 1, name
        assert len(p["losses"]) == steps and p["tokens_per_s"] > 0, name
    for name in PACKED:
        assert paths[name]["loss_diff"] <= TRAIN_64, name
        assert paths[name]["fill"] > paths["none"]["fill"], name  # packing fills more slots than padding
    assert paths["none"]["loss_diff"] is None  # the baseline is the reference, not compared
    # the speed table holds or says why on the path's line: each ratio over padded batches is at most the
    # path's FLOP bound and at least 1, else its note names the cause (the logic: tests/report/test_speed.py)
    lines = proc.stdout.split("== 6. Summary", 1)[1].splitlines()
    for name in PACKED:
        p = paths[name]
        ratio = p["tokens_per_s"] / paths["none"]["tokens_per_s"]
        assert p["bound"] > 1 and len(p["step_ratios"]) == steps - 1, name  # the first step is the warm-up
        assert (p["note"] == "") == (1 <= ratio <= p["bound"]), (name, ratio, p)
        line = next(x for x in lines if x.startswith(f"  {name} "))
        assert f"{p['bound']:.2f}x" in line and (p["note"] or "-") in line, line
    # the trainer path and the padded baseline train on the same conversations: the same first loss
    assert abs(paths["trainer"]["losses"][0] - paths["none"]["losses"][0]) <= TRAIN_64

    # the multimodal section: rows under both budgets, equal to each sample alone, timed against padded
    mm = results["multimodal"]
    assert mm["images"] >= mm["samples"] > 0 and mm["patches"] > 0
    assert mm["patches_max"] <= mm["max_patches"] < mm["patches_max_tokens_only"]  # the budget binds and holds
    assert mm["rows"] > mm["rows_tokens_only"] and 0 < mm["fill"] < mm["fill_tokens_only"] <= 1
    assert set(mm["exact"]) == {"real+padded", "padded-for-both"}
    for diffs in mm["exact"].values():
        assert max(diffs.values()) <= EXACT_MM_64, diffs
    assert mm["packed_tokens_per_s"] > 0 and mm["padded_tokens_per_s"] > 0 and mm["speedup"] > 0


def test_demo_corpus_choices(capsys):
    with pytest.raises(ValueError, match="corpus must be 'chat', 'vqa' or None"):
        next(run_demo(corpus="images"))
    with pytest.raises(SystemExit):
        main(["demo", "--corpus", "images"])
    err = capsys.readouterr().err
    assert "argument --corpus: invalid choice: 'images'" in err and "vqa" in err
