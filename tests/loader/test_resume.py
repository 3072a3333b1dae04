"""Exact resume: state after the k-th row, loaded into a fresh dataset, gives rows k+1... exactly.

In-process at many k (inside a refill, at the epoch boundary, at the end), and
through torchdata's StatefulDataLoader with 0 and 2 workers over 2 ranks.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from sftpack.loader import LoaderStats, PackingDataset, StateError, StatefulLoader
from sftpack.testing import samples_from_lengths

LENGTHS = np.random.default_rng(11).integers(1, 300, 240).tolist() + [700, 1100]  # two split samples
SAMPLES = samples_from_lengths(LENGTHS)
KW = {"max_seq_len": 512, "buffer_size": 24, "pad_multiple": 4, "shuffle": True, "seed": 5, "num_epochs": 2}


def sig(row) -> tuple:
    return (
        row.input_ids.numpy().tobytes(),
        row.labels.numpy().tobytes(),
        row.cu_seqlens_padded.tolist(),
        row.cu_seqlens.tolist(),
        row.sequence_ids,
    )


class Stream:
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


@pytest.mark.parametrize("source", ["map", "iterable"])
def test_resume_at_any_row_in_process(source):
    make = (lambda: SAMPLES) if source == "map" else (lambda: Stream(SAMPLES))
    kw = KW | ({} if source == "map" else {"shuffle": False})
    full = [sig(r) for r in PackingDataset(make(), **kw)]
    ref = PackingDataset(make(), **kw)
    it = iter(ref)
    ks, kinds = [], set()
    for k in range(len(full) + 1):
        st = ref.state_dict()
        # the state is plain data (indices), it survives JSON
        st = json.loads(json.dumps(st))
        if st["pending"] and st["buffer"]:
            kinds.add("decided rows pending")
        if not st["pending"] and st["cursor"] > 0:
            kinds.add("inside a refill")
        if st["epoch"] == 1 and st["cursor"] == 0:
            kinds.add("epoch boundary")
        if k % 7 == 0 or k in (1, len(full)) or (st["epoch"] == 1 and st["cursor"] == 0):
            fresh = PackingDataset(make(), **kw)
            fresh.load_state_dict(st)
            assert [sig(r) for r in fresh] == full[k:], f"resume after row {k}"
            ks.append(k)
        if k < len(full):
            assert sig(next(it)) == full[k]
    assert kinds == {"decided rows pending", "inside a refill", "epoch boundary"}
    assert len(ks) > 10


def test_a_state_refuses_other_arguments_and_other_ranks():
    ds = PackingDataset(SAMPLES, **KW)
    it = iter(ds)
    next(it)
    st = ds.state_dict()
    with pytest.raises(StateError, match=r"other arguments \(buffer_size: saved 24, here 32\)"):
        PackingDataset(SAMPLES, **(KW | {"buffer_size": 32})).load_state_dict(st)
    with pytest.raises(StateError, match="belongs to rank 0 of 1 but this dataset is rank 1 of 2"):
        PackingDataset(SAMPLES, rank=1, world_size=2, **KW).load_state_dict(st)
    with pytest.raises(StateError, match="not a PackingDataset state"):
        PackingDataset(SAMPLES, **KW).load_state_dict({"epoch": 0})


def _loader(nw: int, rank: int, world: int) -> StatefulLoader:
    return StatefulLoader(PackingDataset(SAMPLES, rank=rank, world_size=world, **KW), num_workers=nw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_the_stateful_dataloader_over_two_ranks(num_workers):
    """2 ranks x num_workers: every sample exactly once per epoch; resume at several rows
    (first rows, inside an epoch, the epoch boundary) gives the remaining rows exactly."""
    world = 2
    per_rank = []
    for rank in range(world):
        loader = _loader(num_workers, rank, world)
        per_rank.append([sig(r) for r in loader])
        stats = LoaderStats.from_state(loader.state_dict())
        assert stats.epochs == 2 * max(num_workers, 1) and stats.rows_out == len(per_rank[-1])
    ids = [i for rows in per_rank for r in rows for i in r[4]]
    pieces = {240: 2, 241: 3}  # the split samples appear once per piece
    expect = sorted(2 * [i for i in range(242) for _ in range(pieces.get(i, 1))])
    assert sorted(ids) == expect

    full = per_rank[1]
    epoch_end = None  # the row after which a worker of rank 1 stands at epoch 1, cursor 0 (its epoch 0 done)
    loader = _loader(num_workers, 1, world)
    it = iter(loader)
    states = {}
    for k in range(len(full)):
        assert sig(next(it)) == full[k]
        st = loader.state_dict()
        if k + 1 in (1, 3, len(full) // 2):
            states[k + 1] = copy.deepcopy(st)
        inner = [s for s in _dataset_states(st)]
        if epoch_end is None and any(s["epoch"] == 1 and s["cursor"] == 0 for s in inner):
            epoch_end = k + 1
            states[k + 1] = copy.deepcopy(st)
    assert epoch_end is not None
    for k, st in sorted(states.items()):
        again = _loader(num_workers, 1, world)
        again.load_state_dict(st)
        assert [sig(r) for r in again] == full[k:], f"num_workers={num_workers}: resume after row {k}"

    other = 2 if num_workers == 0 else 0
    with pytest.raises(
        StateError,
        match=f"saved with num_workers={num_workers} but the loader has "
        f"num_workers={other}.*resume with num_workers={num_workers}",
    ):
        _loader(other, 1, world).load_state_dict(states[1])


def _dataset_states(state):
    if isinstance(state, dict):
        if "stats" in state and "cursor" in state:
            yield state
            return
        for v in state.values():
            yield from _dataset_states(v)


def test_a_worker_state_refuses_another_share():
    """Loaded straight into a dataset iterated as another worker count, a worker state says so."""
    loader = _loader(2, 0, 1)
    it = iter(loader)
    for _ in range(3):
        next(it)
    st = next(s for s in _dataset_states(loader.state_dict()) if s["shard"] == 1)
    assert (st["num_shards"], st["num_workers"]) == (2, 2) and st["cursor"] > 0
    ds = PackingDataset(SAMPLES, **KW)
    ds.load_state_dict(st)
    with pytest.raises(
        StateError,
        match=r"saved by worker 1 of num_workers=2.*restored into worker 0 of "
        r"num_workers=1.*resume with num_workers=2",
    ):
        next(iter(ds))


def test_the_chat_pipeline_output_streams_and_resumes():
    """tokenize_conversations(...) is a re-iterable source: read in order, resumed by re-reading."""
    from sftpack.chat import tokenize_conversations
    from sftpack.testing import tiny_chat_tokenizer

    convs = [
        [{"role": "user", "content": "hi " * (i % 7 + 1)}, {"role": "assistant", "content": "yo " * (3 * i % 40 + 1)}]
        for i in range(30)
    ]
    source = tokenize_conversations(convs, tiny_chat_tokenizer("chatml"))
    kw = {"max_seq_len": 128, "buffer_size": 8, "num_epochs": 2}
    full = [sig(r) for r in PackingDataset(source, **kw)]
    assert sorted(i for r in full[: len(full) // 2 + 3] for i in r[4])[:1] == [0]
    ds = PackingDataset(source, **kw)
    it = iter(ds)
    for _ in range(9):
        next(it)
    again = PackingDataset(source, **kw)
    again.load_state_dict(ds.state_dict())
    assert [sig(r) for r in again] == full[9:]
    assert ds.stats.samples_in > 0 and LoaderStats.from_state(ds.state_dict()).rows_out == 9
