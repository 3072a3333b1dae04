"""``sftpack bench --corpus vqa``: the packers' rows and fill on the embedded easy-vqa
corpus, without and with the vision-patch budget."""

from __future__ import annotations

import re

import pytest

from sftpack.cli import main

pytest.importorskip("easy_vqa")


def test_bench_vqa_prints_every_packer_with_and_without_the_patch_budget(capsys):
    args = ["bench", "--corpus", "vqa", "--limit", "24", "--max-seq-len", "1024", "--max-patches-per-row", "2048"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "24 conversations -> 24 samples with" in out
    assert "patch budget 2,048 vision patches per row" in out
    for algo in ("bfd", "ffd", "first_fit_shuffle", "next_fit", "greedy_knapsack"):
        lines = [ln for ln in out.splitlines() if re.match(rf"\s+{algo}\s", ln)]
        assert len(lines) == 2, algo  # without and with the budget
        assert lines[1].split()[1] == "2,048" and lines[1].split()[-3] == "0"  # no row over the budget
    assert re.search(r"one per row\s+-\s+24\s", out)


def test_bench_vqa_refuses_what_it_cannot_do(capsys):
    # conversation 11 of seed 0 has an image of 1,144 patches: no row of 1,024 patches holds it
    assert main(["bench", "--corpus", "vqa", "--limit", "12", "--max-patches", "1024"]) == 1
    err = capsys.readouterr().err
    assert "conversation easy-vqa:train:" in err and "raise the patch budget to at least 1,144" in err
    assert main(["bench", "--corpus", "vqa", "--tokenizer", "x"]) == 2
    assert "drop --tokenizer" in capsys.readouterr().err
    assert main(["bench", "--corpus", "vqa", "--overlong", "truncate"]) == 2
    assert "never cuts inside an image" in capsys.readouterr().err
    assert main(["bench", "--max-patches", "10"]) == 2
    assert "--max-patches-per-row is the vision-patch budget of --corpus vqa" in capsys.readouterr().err
