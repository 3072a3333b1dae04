"""sftpack.report.savings: the layouts compared by ``sftpack bench`` and the demo, checked
against counts computed here by hand."""

from __future__ import annotations

import re

import pytest

from sftpack.binpack import _kernels
from sftpack.report.savings import WARM, bench_lengths, compare_layouts, format_layouts, format_table, load_line
from sftpack.testing import tiny_chat_tokenizer

LENGTHS = [5, 10, 3, 8, 6, 16, 1]  # 49 real tokens


def test_compare_layouts_counts_rows_and_slots():
    rows, bounds = compare_layouts(LENGTHS, 16, algorithms=["bfd", "next_fit"], batch_size=4)
    by = {r.layout: r for r in rows}
    assert bounds == (4, 4)  # ceil(49 / 16) = 4; 16 fills a row alone
    assert by["bfd"].rows == 4 and by["bfd"].efficiency == pytest.approx(49 / 64)
    assert by["next_fit"].rows >= by["bfd"].rows and by["next_fit"].seconds is not None
    one = by["one per row, padded to 16"]
    assert (one.rows, one.per_row, one.seconds) == (7, 1.0, None)
    assert one.efficiency == pytest.approx(49 / (7 * 16))
    batches = by["batches of 4, padded to longest"]  # [5, 10, 3, 8] -> 4 x 10, [6, 16, 1] -> 3 x 16
    assert batches.rows == 2 and batches.efficiency == pytest.approx(49 / (40 + 48))
    assert batches.per_row is None


def test_format_layouts_and_format_table():
    rows, bounds = compare_layouts(LENGTHS, 16, algorithms=["bfd"], batch_size=4)
    text = format_layouts(rows, bounds)
    assert text.splitlines()[0].split() == [
        "layout",
        "rows",
        "real",
        "tokens",
        "/",
        "slots",
        "seqs",
        "per",
        "row",
        "pack",
        "time",
    ]
    assert "76.56%" in text and "lower bounds on rows: L1=4, L2=4\n" in text
    assert text.splitlines()[-1] == load_line(rows) and " bfd " in load_line(rows)
    assert format_table(("x", "n"), [("a", 1234)], indent="").splitlines() == ["x     n", "-  ----", "a  1234"]


def test_bench_lengths_tokenizes_and_compares():
    tok = tiny_chat_tokenizer()
    convs = [[{"role": "user", "content": "hi " * k}, {"role": "assistant", "content": "yo " * k}] for k in range(1, 9)]
    report = bench_lengths(convs, tok, source="test", max_seq_len=64)
    assert report.source == "test" and len(report.lengths) == 8 == report.tokenize_stats.conversations
    assert int(report.lengths.sum()) == report.tokenize_stats.tokens
    assert {r.layout for r in report.layouts} >= {"bfd", "one per row, padded to 64"}


def test_compiler_load_is_timed_apart_from_packing():
    """The first, separately timed call of each packer runs its numba kernels (more lengths
    than the plain-Python kernels take), so the pack time after it holds no compiler load."""
    assert WARM > _kernels.PLAIN_MAX_ITEMS
    assert _kernels.kernels(WARM) is not _kernels.PLAIN  # the compiled kernels (and numba now loaded)
    lengths = [(7 * i) % 61 + 1 for i in range(200)]
    rows, _ = compare_layouts(lengths, 64, algorithms=["bfd", "ffd"])
    for r in rows[:2]:
        assert r.seconds is not None and r.load_seconds is not None and r.load_seconds >= 0, r
    for r in rows[2:]:  # the layouts that do not pack load nothing
        assert r.seconds is None and r.load_seconds is None
    line = format_layouts(rows, (1, 1)).splitlines()[-1]
    assert re.fullmatch(
        r"  compiler load \(each packer's first call, once per process; not in pack time\): "
        r"bfd \d+\.\d ms, ffd \d+\.\d ms",
        line,
    ), line  # the two packers, and not the layouts that do not pack
