"""Resume through 2 workers when one worker's share of the epoch has already ended.

Worker 0's share makes six rows, worker 1's one, so after the third row of an
epoch worker 1 has ended its share while worker 0 still yields. A state taken
then and loaded into a fresh loader must finish the epoch with worker 0's rows
only (worker 1 must not start its next epoch early), and ``set_epoch(1)`` must
then give epoch 1 once: the rows over both epochs are those of a run never
interrupted (no row twice, none missing).
"""

from __future__ import annotations

import copy

import pytest

from sftpack.loader import PackingDataset, StatefulLoader
from sftpack.testing import samples_from_lengths

# share of worker w: positions w, w+2, ...: worker 0 six rows of 60 tokens, worker 1 six short samples in one row
SAMPLES = samples_from_lengths([60, 5] * 6)
KW = {"max_seq_len": 64, "buffer_size": 8, "pad_multiple": 4, "num_epochs": 1}
EPOCHS = 2


def run(loader: StatefulLoader, ds: PackingDataset, *, stop_at: int | None = None) -> tuple[list, dict | None]:
    rows = []
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        for row in loader:
            rows.append(row.sequence_ids)
            if len(rows) == stop_at:
                return rows, copy.deepcopy(loader.state_dict())
    return rows, None


@pytest.mark.parametrize("persistent", [False, True])
def test_state_after_one_worker_ended_its_share(persistent: bool) -> None:
    def make(ds: PackingDataset) -> StatefulLoader:
        return StatefulLoader(ds, num_workers=2, persistent_workers=persistent)

    ds = PackingDataset(SAMPLES, **KW)
    full, _ = run(make(ds), ds)
    per_epoch = len(full) // EPOCHS
    assert per_epoch == 7 and full[:per_epoch] == full[per_epoch:]
    for k in (3, 5):  # worker 1's only row was row 2: it has ended, worker 0 has not
        ds = PackingDataset(SAMPLES, **KW)
        head, state = run(make(ds), ds, stop_at=k)
        assert state is not None
        ds2 = PackingDataset(SAMPLES, **KW)
        loader = make(ds2)
        loader.load_state_dict(state)
        rest = [row.sequence_ids for row in loader]  # the rest of epoch 0: no set_epoch
        assert head + rest == full[:per_epoch], f"k={k}: the resumed epoch 0 differs"
        for epoch in range(1, EPOCHS):
            ds2.set_epoch(epoch)
            rest += [row.sequence_ids for row in loader]
        assert head + rest == full, f"k={k}: {len(head) + len(rest)} rows instead of {len(full)}"
