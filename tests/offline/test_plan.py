"""Stage 2 on its own (``_plan``): where every sequence lands, the planners the driver
uses (bin packing, or a packing kept from an importer), and the one width check."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.handoff import padded_lengths
from sftpack.offline import PrepackError
from sftpack.offline._plan import BinPack, KeepRows, check_width
from sftpack.offline.engine import plan_from_membership, plan_rows


def test_a_plan_lays_the_rows_end_to_end_without_padding():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 200)
    plan = plan_rows(lengths, max_seq_len=64, pad_multiple=4, algorithm="ffd")
    np.testing.assert_array_equal(plan.lengths, lengths[plan.order])
    np.testing.assert_array_equal(plan.starts, np.concatenate([[0], np.cumsum(plan.lengths)[:-1]]))
    tok = plan.row_token_offsets()
    assert tok[0] == 0 and tok[-1] == plan.num_tokens == int(lengths.sum())
    # row r's tokens are the sum of its sequences' lengths, and its padded cost fits the width
    per_row = np.add.reduceat(plan.lengths, plan.row_offsets[:-1])
    np.testing.assert_array_equal(np.diff(tok), per_row)
    assert np.add.reduceat(padded_lengths(plan.lengths, 4), plan.row_offsets[:-1]).max() <= 64
    assert plan.l1 <= plan.l2 <= plan.num_rows


def test_a_kept_membership_keeps_input_order_and_refuses_bad_offsets():
    plan = plan_from_membership([5, 10, 3, 8, 6], [0, 2, 5], max_seq_len=32)
    assert plan.order.tolist() == [0, 1, 2, 3, 4] and plan.row_offsets.tolist() == [0, 2, 5]
    for bad in ([0, 2, 4], [1, 5], [0, 3, 3, 5]):
        with pytest.raises(ValueError, match="row_offsets must run from 0 to the number of samples"):
            plan_from_membership([5, 10, 3, 8, 6], bad, max_seq_len=32)
    with pytest.raises(ValueError, match=r"row 0 needs 20 slots .* multiple of 4, more than max_seq_len=16"):
        plan_from_membership([5, 10], [0, 2], max_seq_len=16, pad_multiple=4)


def test_keep_rows_reads_its_sizes_when_planning_and_can_size_the_rows():
    sizes: list[int] = []
    planner = KeepRows(sizes, None, pad_multiple=4)
    sizes += [2, 3]  # filled after the planner was made, as an importer's samples stream
    plan = planner.plan([5, 10, 3, 8, 6])
    # widest row: [3, 8, 6] padded to 4, 8, 8 = 20 slots
    assert plan.max_seq_len == 20 and plan.pad_multiple == 4 and plan.row_offsets.tolist() == [0, 2, 5]
    assert planner.fingerprint() == {"algorithm": "kept from the source", "seed": None}
    with pytest.raises(PrepackError, match="row_sizes add up to 5 samples but 4 came in"):
        planner.plan([5, 10, 3, 8])


def test_bin_pack_is_checked_once_and_plans_what_plan_rows_plans():
    planner = BinPack(64, 4, "first_fit_shuffle", 9)
    assert planner.fingerprint() == {"algorithm": "first_fit_shuffle", "seed": 9}
    lengths = np.random.default_rng(1).integers(1, 60, 100)
    want = plan_rows(lengths, max_seq_len=64, pad_multiple=4, algorithm="first_fit_shuffle", seed=9)
    np.testing.assert_array_equal(planner.plan(lengths).order, want.order)
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        BinPack(64, 4, "bfd", -1)
    with pytest.raises(ValueError, match="algorithm='best' is not valid"):
        BinPack(64, 4, "best")


@pytest.mark.parametrize(
    ("width", "multiple", "message"),
    [
        (0, 1, "max_seq_len must be a positive integer, got 0"),
        (64, 0, "pad_multiple must be a positive integer, got 0"),
        (2**24 + 1, 1, "is wider than sftpack's limit"),
        (1000, 16, "max_seq_len=1000 is not a multiple of pad_multiple=16: .*use max_seq_len=1008 or 992$"),
        (8, 16, "use max_seq_len=16$"),
    ],
)
def test_the_width_check_gives_one_message_per_problem(width, multiple, message):
    with pytest.raises(ValueError, match=message):
        check_width(width, multiple)


def test_rows_recorded_by_stage_1_are_kept_and_bin_packing_refuses_them():
    plan = KeepRows(None, None, pad_multiple=1).plan([5, 10, 3, 8, 6], np.array([1, 4]))
    assert plan.row_offsets.tolist() == [0, 1, 5] and plan.max_seq_len == 27
    with pytest.raises(ValueError, match="KeepRows needs the row sizes"):
        KeepRows(None, 32).plan([5, 10])
    with pytest.raises(ValueError, match="bin packing plans its own rows, but the samples came in rows"):
        BinPack(32).plan([5, 10], np.array([2]))
