"""A share with nothing to read is refused with a clear error, never looped over (issue 16, item 9).

Before the fix, ``PackingDataset(num_epochs=None)`` re-opened an empty share forever without
yielding or raising, and with one epoch an empty share yielded 0 rows while the other ranks
yielded some (a DDP step then waits forever). Every test here terminates even if that bug
returns: the sources below count how often the loader opens them and raise after ``LIMIT``
epochs (a spinning loader re-opens its share once per epoch), and every iteration is bounded
with ``islice``. Nothing depends on timing.
"""

from __future__ import annotations

from itertools import islice

import pytest
import torch

from sftpack.loader import PackingDataset
from sftpack.testing import samples_from_lengths

LIMIT = 50  # epochs a loader may open its share before the source calls it spinning
STEPS = 20  # rows any test asks for at most


class Spun(RuntimeError):
    """Raised by a bounded source: the loader re-opened its share LIMIT times (the bug)."""


class Bounded:
    """A map-style source (len() and [i]); each epoch asks len() a bounded number of times."""

    def __init__(self, samples):
        self.samples = list(samples)
        self.calls = 0

    def __len__(self):
        self.calls += 1
        if self.calls > 3 * LIMIT:
            raise Spun(f"len() asked {self.calls} times: the loader is spinning on an empty share")
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


class BoundedStream:
    """A re-iterable source (no len()); the loader calls iter() once per epoch."""

    def __init__(self, samples):
        self.samples = list(samples)
        self.calls = 0

    def __iter__(self):
        self.calls += 1
        if self.calls > LIMIT:
            raise Spun(f"iter() called {self.calls} times: the loader is spinning on an empty share")
        return iter(self.samples)


SOURCES = {"map": Bounded, "iterable": BoundedStream}
EPOCHS = [None, 1]
KW = {"max_seq_len": 64, "buffer_size": 4}


def rows(ds, steps: int = STEPS) -> list:
    return list(islice(iter(ds), steps))


@pytest.mark.parametrize("num_epochs", EPOCHS)
@pytest.mark.parametrize("kind", SOURCES)
def test_an_empty_source_is_refused(kind, num_epochs):
    ds = PackingDataset(SOURCES[kind]([]), num_epochs=num_epochs, **KW)
    msg = r"PackingDataset \(rank 0 of world_size=1, worker 0 of num_workers=0\): " + (
        r"the source holds no sample: give it at least one"
        if kind == "map"
        else r"epoch 0 of share 0 of 1 emitted no row: it read no sample.*use fewer ranks x workers, or more"
    )
    with pytest.raises(ValueError, match=msg):
        rows(ds)


@pytest.mark.parametrize("num_epochs", EPOCHS)
def test_more_ranks_than_samples_is_refused_on_every_rank_of_a_map_style_source(num_epochs):
    """Every rank can count the shares of a map-style source, so every rank refuses, together:
    no rank starts a DDP step that another will never join."""
    for rank in range(3):
        ds = PackingDataset(Bounded(samples_from_lengths([5, 9])), rank=rank, world_size=3, num_epochs=num_epochs, **KW)
        with pytest.raises(
            ValueError,
            match=rf"\(rank {rank} of world_size=3, worker 0 of num_workers=0\): the "
            r"source holds 2 samples but they are dealt to 3 shares \(world_size=3 "
            r"x 1 worker\(s\) per rank\), so 1 share\(s\) get none.*DDP step waits "
            r"forever\): use at most 2 ranks, or more samples",
        ):
            rows(ds)


@pytest.mark.parametrize("num_epochs", EPOCHS)
def test_more_ranks_than_samples_in_a_stream_refuses_on_the_rank_with_none(num_epochs):
    """A stream's length is only known by reading it: the rank with no sample refuses at the end
    of its (empty) epoch; the others yield their rows (and, endless, keep yielding)."""
    lengths = [5, 9]
    r0 = rows(
        PackingDataset(BoundedStream(samples_from_lengths(lengths)), rank=0, world_size=3, num_epochs=num_epochs, **KW)
    )
    assert [r.sequence_ids for r in r0] == [(0,)] * (1 if num_epochs == 1 else STEPS)
    with pytest.raises(
        ValueError,
        match=r"\(rank 2 of world_size=3, worker 0 of num_workers=0\): epoch 0 of share 2 "
        r"of 3 emitted no row: it read no sample",
    ):
        rows(
            PackingDataset(
                BoundedStream(samples_from_lengths(lengths)), rank=2, world_size=3, num_epochs=num_epochs, **KW
            )
        )


@pytest.mark.parametrize("num_epochs", EPOCHS)
@pytest.mark.parametrize("kind", SOURCES)
def test_more_workers_than_samples_through_a_real_dataloader(kind, num_epochs):
    """torch DataLoader with num_workers=2 over one sample: worker 1 has no share. The error is
    raised in the worker and re-raised by the DataLoader in the main process."""
    ds = PackingDataset(SOURCES[kind](samples_from_lengths([7])), num_epochs=num_epochs, **KW)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    if kind == "map":
        msg = (
            r"\(rank 0 of world_size=1, worker [01] of num_workers=2\): the source holds 1 samples but they are "
            r"dealt to 2 shares.*use num_workers <= 1, or more samples"
        )
    else:
        msg = r"\(rank 0 of world_size=1, worker 1 of num_workers=2\): epoch 0 of share 1 of 2 emitted no row"
    with pytest.raises(ValueError, match=msg):
        rows(loader)


@pytest.mark.parametrize("num_epochs", EPOCHS)
@pytest.mark.parametrize("kind", SOURCES)
def test_a_share_whose_samples_are_all_dropped_as_overlong_is_refused(kind, num_epochs):
    """Rank 0 reads samples 0 and 2 (both longer than a row), rank 1 samples 1 and 3 (short)."""
    samples = samples_from_lengths([100, 5, 80, 9])
    kw = KW | {"overlong": "drop", "num_epochs": num_epochs, "world_size": 2}
    good = rows(PackingDataset(SOURCES[kind](samples), rank=1, **kw))
    assert good and all(r.sequence_ids == (1, 3) for r in good)
    with pytest.raises(
        ValueError,
        match=r"\(rank 0 of world_size=2, worker 0 of num_workers=0\): epoch 0 of share 0 "
        r"of 2 emitted no row: all 2 of its samples are longer than max_seq_len=64 "
        r"and were dropped \(overlong='drop'\).*raise max_seq_len, or pass "
        r"overlong='split' or 'truncate'",
    ):
        rows(PackingDataset(SOURCES[kind](samples), rank=0, **kw))
    # a single rank whose every sample is dropped: the same error, counted
    every = PackingDataset(SOURCES[kind](samples_from_lengths([100, 80])), overlong="drop", num_epochs=num_epochs, **KW)
    with pytest.raises(ValueError, match=r"all 2 of its samples are longer than max_seq_len=64"):
        rows(every)
    assert (every.stats.samples_in, every.stats.dropped, every.stats.rows_out) == (2, 2, 0)


@pytest.mark.parametrize("kind", SOURCES)
def test_shares_with_rows_are_untouched_and_endless_keeps_yielding(kind):
    """The refusal is only for a share that yields nothing: endless loaders over a few samples
    keep yielding, epoch after epoch, on every rank."""
    samples = samples_from_lengths([5, 9, 30])
    for rank in range(3):
        got = rows(PackingDataset(SOURCES[kind](samples), rank=rank, world_size=3, num_epochs=None, **KW))
        assert [r.sequence_ids for r in got] == [(rank,)] * STEPS


def test_train_packing_loader_with_more_ranks_than_conversations_stops_on_every_rank():
    """``sftpack train --packing loader`` under torchrun with 3 ranks and 2 conversations: each
    rank's data source (what the trainer builds for it) refuses at its first step, instead of two
    ranks training while the third spins forever (the run used to never end)."""
    from sftpack.loop import TrainConfig, make_source

    cfg = TrainConfig(packing="loader", batch_size=3, max_seq_len=64, buffer_size=4)
    for rank in range(3):
        source = make_source(cfg, samples=Bounded(samples_from_lengths([20, 30])), rank=rank, world=3)
        with pytest.raises(
            ValueError,
            match=rf"rank {rank} of world_size=3.*the source holds 2 samples but they are "
            r"dealt to 3 shares.*use at most 2 ranks",
        ):
            source.next_step()
    ok = make_source(cfg, samples=samples_from_lengths([20, 30, 9]), rank=2, world=3)
    assert [mb for mb in ok.next_step()]  # three conversations, three ranks: each has a row per step
