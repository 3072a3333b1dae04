"""Bad input to the packer is a clear error, never a silent change (issue 9, item 9).

Each case goes through the public API and checks the error type and that the
message names the index and the value (or the item / row) and the fix.
"""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.binpack import (
    Bins,
    HistogramBins,
    lower_bounds,
    pack,
    pack_histogram,
    packing_stats,
)

LENGTHS = [5, 10, 3, 8, 6]  # packs as [[1, 4], [3, 0, 2]] in rows of 16


# ----------------------------------------------------------------------------
# lengths that are not int64 integers


@pytest.mark.parametrize(
    ("lengths", "shown"),
    [
        ([3, "7", 2], "lengths[1] = '7' is not an integer"),
        ([3, 2.5], "lengths[1] = 2.5 is not an integer"),
        (np.array([4.0, 2.0]), "lengths[0] = 4.0 is not an integer"),
        ([3, None], "lengths[1] = None is not an integer"),
        (np.array([True, False]), "lengths[0] = True is not an integer"),
        (np.array(["4", "5"]), "lengths[0] = '4' is not an integer"),
    ],
)
def test_non_integer_lengths_name_the_index_and_value(lengths, shown):
    for call in (lambda: pack(lengths, 16), lambda: lower_bounds(lengths, 16), lambda: pack(lengths, 16, "next_fit")):
        with pytest.raises(TypeError, match="lengths must be integers") as err:
            call()
        assert shown in str(err.value)
        assert "astype(np.int64)" in str(err.value)


@pytest.mark.parametrize(
    ("lengths", "shown"),
    [
        ([3, 2**63], "lengths[1] = 9223372036854775808 does not fit in int64"),  # numpy would make it a float
        ([2**64 + 5, 1], "lengths[0] = 18446744073709551621 does not fit in int64"),
        ([1, -(2**64)], "lengths[1] = -18446744073709551616 does not fit in int64"),
        (np.array([7, 2**64 - 1], np.uint64), "lengths[1] = 18446744073709551615 does not fit in int64"),
        (np.array([2**63, 4], np.uint64), "lengths[0] = 9223372036854775808 does not fit in int64"),
    ],
)
def test_lengths_beyond_int64_are_never_reported_negative(lengths, shown):
    with pytest.raises(ValueError, match="does not fit in int64") as err:
        pack(lengths, 16)
    assert shown in str(err.value)
    assert "-9223372036854775" not in str(err.value)  # no wrapped value anywhere


def test_uint64_and_object_lengths_within_int64_are_accepted():
    expected = pack(LENGTHS, 16)
    assert pack(np.array(LENGTHS, np.uint64), 16) == expected
    assert pack(np.array(LENGTHS, dtype=object), 16) == expected
    # a uint64 length that fits int64 but not the row: the ordinary too-long error, with its true value
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9223372036854775807 is longer than the capacity 16"):
        pack(np.array([3, 2**63 - 1], np.uint64), 16)


def test_counts_of_a_histogram_are_checked_the_same_way():
    with pytest.raises(TypeError, match=r"counts\[1\] = 0.5 is not an integer"):
        pack_histogram([3, 4], [1, 0.5], 8)
    with pytest.raises(ValueError, match=r"counts\[0\] = 18446744073709551615 does not fit in int64"):
        pack_histogram([3, 4], np.array([2**64 - 1, 1], np.uint64), 8)
    with pytest.raises(ValueError, match=r"counts must be >= 0, got counts\[1\] = -2"):
        lower_bounds([3, 4], 8, counts=[1, -2])


# ----------------------------------------------------------------------------
# Bins refuses what is not a packing


def test_bins_refuses_duplicate_and_out_of_range_indices():
    with pytest.raises(ValueError, match=r"Bins order holds index 0 2 times \(order\[0\] and order\[2\]\)"):
        Bins([0, 1, 0], [0, 2, 3])
    with pytest.raises(ValueError, match=r"Bins order\[1\] = 3 is outside 0..2"):
        Bins([0, 3, 1], [0, 3])
    with pytest.raises(ValueError, match=r"Bins order\[0\] = -1 is outside 0..1"):
        Bins([-1, 0], [0, 2])
    with pytest.raises(TypeError, match=r"order\[1\] = 1.5 is not an integer"):
        Bins([0, 1.5], [0, 2])
    with pytest.raises(ValueError, match="no empty bin"):
        Bins([0, 1], [0, 0, 2])
    assert Bins([2, 0, 1], [0, 1, 3]).to_lists() == [[2], [0, 1]]


# ----------------------------------------------------------------------------
# packing_stats refuses bins that do not cover the items exactly once


def test_packing_stats_refuses_missing_repeated_or_foreign_items():
    with pytest.raises(ValueError, match="item 2 is in no bin: every sequence must be packed exactly once"):
        packing_stats(LENGTHS, [[1, 4], [3, 0]], 16)
    with pytest.raises(ValueError, match="the bins hold 6 items but lengths has 5"):
        packing_stats(LENGTHS, Bins([1, 4, 3, 0, 2, 5], [0, 2, 6]), 16)
    with pytest.raises(ValueError, match="the bins hold 4 items but lengths has 5"):
        packing_stats(LENGTHS, Bins([1, 3, 0, 2], [0, 1, 4]), 16)
    with pytest.raises(ValueError, match=r"item 4 is packed 2 times \(bins\[0\] and bins\[1\]\)"):
        packing_stats(LENGTHS, [[1, 4], [3, 0, 4]], 16)  # 4 twice, 2 never
    with pytest.raises(ValueError, match=r"bins\[1\] holds item 7, outside 0..4"):
        packing_stats(LENGTHS, [[1, 4], [3, 0, 7]], 16)
    with pytest.raises(ValueError, match=r"bins\[1\] is empty"):
        packing_stats(LENGTHS, [[1, 4], [], [3, 0, 2]], 16)
    with pytest.raises(TypeError, match=r"bins\[0\]\[1\] = 4.0 is not an integer"):
        packing_stats(LENGTHS, [[1, 4.0], [3, 0, 2]], 16)


def test_packing_stats_refuses_rows_over_the_capacity():
    with pytest.raises(ValueError, match="bin 0 costs 18 tokens, more than the capacity 16"):
        packing_stats(LENGTHS, [[1, 3], [4, 0, 2]], 16)  # 10 + 8
    # 5 + 3 + 6 = 14 tokens fit, but padded to multiples of 4 they cost 8 + 4 + 8 = 20
    assert packing_stats(LENGTHS, [[1], [3], [0, 2, 4]], 16).rows == 3
    with pytest.raises(ValueError, match="bin 2 costs 20 tokens, more than the capacity 16"):
        packing_stats(LENGTHS, [[1], [3], [0, 2, 4]], 16, cost_multiple=4)


def test_packing_stats_accepts_every_exact_packing_form():
    bins = pack(LENGTHS, 16)
    expected = packing_stats(LENGTHS, bins, 16)
    assert packing_stats(LENGTHS, bins.to_lists(), 16) == expected
    assert packing_stats(LENGTHS, [np.array(row, np.int32) for row in bins], 16) == expected
    # histogram form: items numbered by expanding the histogram (lengths 6, 6, 6, 2)
    assert packing_stats([6, 2], [[0, 3], [1], [2]], 10, counts=[3, 1]).rows == 3


def test_packing_stats_checks_histogram_bins_against_the_histogram():
    hb = pack_histogram([6, 2], [3, 3], 10)
    assert packing_stats([6, 2], hb, 10, counts=[3, 3]).rows == 3
    assert packing_stats([6, 6, 6, 2, 2, 2], hb, 10).rows == 3  # lengths one per item
    with pytest.raises(ValueError, match="the bins hold 3 sequences of length 2 but lengths has 2"):
        packing_stats([6, 2], hb, 10, counts=[3, 2])
    with pytest.raises(ValueError, match="the bins hold 0 sequences of length 5 but lengths has 1"):
        packing_stats([6, 2, 5], hb, 10, counts=[3, 3, 1])
    forged = HistogramBins(np.array([0, 1]), np.array([6]), np.array([2]))  # two 6s in a row of 10
    with pytest.raises(ValueError, match="bin 0 costs 12 tokens, more than the capacity 10"):
        packing_stats([6], forged, 10, counts=[2])
