"""Elastic resume at scale, on paper: a run saved at 1,024 data-parallel ranks continues at 768
(issue 41, item 4) on every path, the global stream going on exactly, nothing read twice or skipped.

No process group is needed: every path's step is decided alike on every rank from the global
stream (the trainer path's seeded order of conversations, the offline path's seeded order of rows,
the loader path's global packer) and the step's work dealt by cost, so the ranks' shares are read
here in one process. 3,072 rows a step on the offline and loader paths (3 a rank at 1,024 ranks,
4 at 768: a global batch both world sizes divide) and 3,072 conversations on the trainer path, over
a few thousand tiny samples.
"""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.loop import make_source
from sftpack.offline import PrepackedDataset, prepack_samples
from sftpack.testing import samples_from_lengths
from sftpack.trainer import plan_microbatches
from tests.helpers import tiny_config

BATCH = 3_072
BEFORE, AFTER = 1_024, 768


@pytest.fixture(scope="module")
def samples():
    lengths = np.random.default_rng(41).integers(1, 9, 16_000)
    return samples_from_lengths(lengths.tolist())


def _cfg(packing: str):
    return tiny_config(packing=packing, batch_size=BATCH, max_seq_len=8, buffer_size=64)


def test_offline_1024_to_768(samples, tmp_path):
    path = prepack_samples(samples, tmp_path / "rows", max_seq_len=8).path
    one = PrepackedDataset(path, shuffle=True, seed=_cfg("offline").seed)
    order = one.epoch_order()
    assert one.num_rows >= 2 * BATCH
    src = make_source(_cfg("offline"), prepacked=path, rank=0, world=BEFORE)
    src.next_step()
    state = src.state_dict()
    assert state == {"epoch": 0, "rows": BATCH}  # global: the same at any world size, on any rank
    later = make_source(_cfg("offline"), prepacked=path, rank=AFTER - 1, world=AFTER)
    later.load_state_dict(state)
    first = src.ds.step_rows(0, BATCH)  # (1,024, 3): what every rank read in step 0
    second = later.ds.step_rows(state["rows"], BATCH)  # (768, 4): what they read next
    assert first.shape == (BEFORE, 3) and second.shape == (AFTER, 4)
    read = np.concatenate([first.ravel(), second.ravel()])
    assert np.array_equal(np.sort(read), np.sort(order[: 2 * BATCH]))  # the 1-rank stream: once each, none skipped
    assert later.next_step()[0].num_sequences >= 4  # the last rank at 768 reads its 4 rows


def test_loader_1024_to_768(samples):
    one = make_source(_cfg("loader"), samples=samples)
    straight = [sorted(tuple(r.sequence_ids) for rank in one.step_rows() for r in rank) for _ in range(2)]
    src = make_source(_cfg("loader"), samples=samples, rank=0, world=BEFORE)
    step0 = src.step_rows()
    assert len(step0) == BEFORE and {len(r) for r in step0} == {3}
    assert sorted(tuple(r.sequence_ids) for rank in step0 for r in rank) == straight[0]
    later = make_source(_cfg("loader"), samples=samples, rank=0, world=AFTER)
    later.load_state_dict(src.state_dict())
    step1 = later.step_rows()
    assert len(step1) == AFTER and {len(r) for r in step1} == {4}
    assert sorted(tuple(r.sequence_ids) for rank in step1 for r in rank) == straight[1]


def test_trainer_1024_to_768(samples):
    one = make_source(_cfg("trainer"), samples=samples)
    src = make_source(_cfg("trainer"), samples=samples, rank=0, world=BEFORE)
    src.next_step()
    one.next_step()
    assert src.state_dict() == one.state_dict()
    later = make_source(_cfg("trainer"), samples=samples, rank=0, world=AFTER)
    later.load_state_dict(src.state_dict())
    nxt = one.next_step()  # the 1-rank run's step 1: every conversation of the global batch
    mine = {i for mb in later.next_step() for i in mb.sequence_ids}
    assert mine and mine <= {i for mb in nxt for i in mb.sequence_ids}
    lengths = np.concatenate([mb.seqlens.numpy() for mb in nxt])
    assert lengths.shape == (BATCH,)
    plan = plan_microbatches(lengths, 8, dp_size=AFTER)  # the plan every rank at 768 makes
    assert sorted(np.concatenate([mb for rank in plan.microbatches for mb in rank]).tolist()) == list(range(BATCH))
