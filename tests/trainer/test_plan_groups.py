"""The micro-batch planner keeps groups whole (DPO pairs, GRPO completions): one micro-batch of one rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftpack.trainer import PlanError, plan_microbatches


@st.composite
def grouped_batches(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=20))  # members per group
    n = sum(sizes)
    lens = draw(st.lists(st.integers(1, 24), min_size=n, max_size=n))
    ids = draw(st.permutations(list(range(len(sizes)))))
    groups = np.repeat(np.asarray(ids) * 3 - 5, sizes)
    order = draw(st.permutations(list(range(n))))  # members need not be adjacent
    return lens, groups[np.asarray(order)].tolist()


@given(
    batch=grouped_batches(),
    dp=st.integers(1, 4),
    m=st.sampled_from([1, 2, 4]),
    cost=st.sampled_from(["tokens", "attention"]),
    algorithm=st.sampled_from(["bfd", "next_fit", "first_fit_shuffle"]),
    max_seqs=st.none() | st.integers(4, 6),
    patch_cap=st.none() | st.integers(40, 80),
    min_mb=st.none() | st.integers(1, 3),
)
@settings(max_examples=80, deadline=None)
def test_plan_keeps_groups_whole(batch, dp, m, cost, algorithm, max_seqs, patch_cap, min_mb):
    lens, groups = batch
    budget = 64
    arr, g = np.asarray(lens), np.asarray(groups)
    patches = (arr * 7) % 11
    kw = dict(dp_size=dp, cost=cost, pad_multiple=m, algorithm=algorithm, min_microbatches=min_mb)
    kw |= dict(max_sequences_per_microbatch=max_seqs, patches=patches, max_patches_per_row=patch_cap)
    n_groups = len(set(groups))
    try:
        plan = plan_microbatches(lens, budget, groups=groups, **kw)
    except PlanError as e:
        msg = str(e)
        if "a group is never split over micro-batches" in msg:  # one group over a budget
            sizes = np.bincount(np.unique(g, return_inverse=True)[1])
            padded = -(-arr // m) * m
            per = [padded[g == x].sum() for x in np.unique(g)]
            pat = [patches[g == x].sum() for x in np.unique(g)]
            assert (
                max(per) > budget
                or (max_seqs is not None and sizes.max() > max_seqs)
                or (patch_cap is not None and max(pat) > patch_cap)
            )
        else:  # too few groups for the micro-batches every rank must run
            assert "cannot give" in msg and "groups (" in msg, msg
            assert "the same number of micro-batches" in msg or n_groups < dp * (min_mb or 1)
        return
    padded = -(-arr // m) * m
    M = plan.num_microbatches
    assert plan.dp_size == dp and all(len(rank) == M >= (min_mb or 1) for rank in plan.microbatches)
    flat = np.concatenate([mb for rank in plan.microbatches for mb in rank])
    assert sorted(flat.tolist()) == list(range(len(lens)))  # every sequence exactly once
    where = {}
    for r, rank in enumerate(plan.microbatches):
        for i, mb in enumerate(rank):
            assert len(mb) >= 1
            assert plan.tokens[r, i] == padded[mb].sum() <= budget
            assert max_seqs is None or len(mb) <= max_seqs
            assert patch_cap is None or patches[mb].sum() <= patch_cap
            for j in mb.tolist():
                where.setdefault(groups[j], set()).add((r, i))
    assert all(len(at) == 1 for at in where.values())  # each group in one micro-batch of one rank
    # groups dealt by LPT, then moves and swaps: the heaviest rank at most one group above the lightest
    costs = padded.astype(float) if cost == "tokens" else padded.astype(float) ** 2
    heaviest = max(costs[g == x].sum() for x in np.unique(g))
    loads = plan.rank_loads
    if min_mb is None and loads.min() > 0:  # no group moved to even out the counts
        assert loads.max() - loads.min() <= heaviest + 1e-9
    again = plan_microbatches(lens, budget, groups=groups, **kw)
    assert [[b.tolist() for b in rank] for rank in again.microbatches] == [
        [b.tolist() for b in rank] for rank in plan.microbatches
    ]


def test_plan_without_groups_is_unchanged():
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 900, 600)
    for algorithm in ("bfd", "next_fit", "first_fit_shuffle"):
        kw = dict(dp_size=4, cost="attention", pad_multiple=8, algorithm=algorithm, min_microbatches=2)
        plain = plan_microbatches(lens, 4096, **kw)
        for other in (
            plan_microbatches(lens, 4096, groups=None, **kw),
            plan_microbatches(lens, 4096, groups=np.arange(600), **kw),
        ):
            assert [[b.tobytes() for b in rank] for rank in other.microbatches] == [
                [b.tobytes() for b in rank] for rank in plain.microbatches
            ]
            assert other.loads.tobytes() == plain.loads.tobytes() and other.bound == plain.bound


def test_plan_group_errors_name_the_group():
    with pytest.raises(PlanError, match=r"group 4 \(2 sequences: \[1, 2\]\) has 20 padded tokens in all.*at least 20"):
        plan_microbatches([5, 10, 7, 8], 16, pad_multiple=4, groups=[0, 4, 4, 0])
    with pytest.raises(PlanError, match=r"group 0 \(3 sequences.*max_sequences_per_microbatch to at least 3"):
        plan_microbatches([1, 1, 1], 16, groups=[0, 0, 0], max_sequences_per_microbatch=2)
    with pytest.raises(PlanError, match=r"2 groups \(4 sequences, a group never split\) cannot give 3 data-parallel"):
        plan_microbatches([1, 1, 1, 1], 16, dp_size=3, groups=[0, 0, 1, 1])
    with pytest.raises(PlanError, match="groups has 1 entries but there are 2 sequences"):
        plan_microbatches([1, 1], 16, groups=[0])
