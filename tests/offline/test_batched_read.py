"""Batched row reads (PrepackedDataset.batch / read_rows / __getitems__): byte for byte the
rows read one by one and laid end to end by the existing collate, whatever the layout."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from sftpack import PackedBatch, Sample
from sftpack.offline import PrepackedDataset, PrepackError, prepack_samples
from sftpack.offline._dataset import BatchedRows

FIELDS = ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded")

#: conversation ids of every kind the id decoder meets: plain strings (the direct path), strings
#: JSON escapes (quote, backslash, control), non-ASCII, and non-strings (JSON numbers, lists)
IDS = ["plain", 'a "quoted" id', "back\\slash", "tab\there", "é-ü-日本", 17, -3, ["x", 1], "", "z"]


def assert_same(got: PackedBatch, want: PackedBatch) -> None:
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and a.shape == b.shape, (f, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f
    assert type(got.max_seqlen) is int and got.max_seqlen == want.max_seqlen
    assert got.sequence_ids == want.sequence_ids
    assert [type(x) for x in got.sequence_ids or ()] == [type(x) for x in want.sequence_ids or ()]
    assert got.source_rows == want.source_rows and got.source_batch_size == want.source_batch_size
    for pad_between in (True, False):  # what the kernel is handed in either boundary mode
        for a, b in zip(boundaries(got, pad_between), boundaries(want, pad_between)):
            assert torch.equal(a, b)
    got.validate()


def boundaries(b: PackedBatch, pad_between: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (b.cu_seqlens if pad_between else b.cu_seqlens_padded), b.cu_seqlens_padded


def rowwise(ds: PrepackedDataset, indices) -> PackedBatch:
    """The reference: row by row, through the existing collate (PackedBatch.concat)."""
    return PackedBatch.concat([ds[int(i)] for i in indices])


def synthetic(path, *, vocab: int, pad_multiple: int, max_seq_len: int, lengths, seed: int = 0):
    rng = np.random.default_rng(seed)
    samples = [
        Sample(rng.integers(0, vocab, n), rng.random(n) < 0.6, IDS[i % len(IDS)] if i < len(IDS) else f"c{i}")
        for i, n in enumerate(lengths)
    ]
    return prepack_samples(
        samples, path, max_seq_len=max_seq_len, pad_multiple=pad_multiple, vocab_size=vocab, pad_id=vocab - 1
    ).path


# uint8 / uint16 / uint32 token files; pad multiples 1 (no padding between sequences), 2 and 8;
# rows of a single long sequence, rows of > 32 short ones (lay_row's scatter branch), length-1 sequences
CASES = {
    "uint8-pad1": dict(vocab=250, pad_multiple=1, max_seq_len=64, lengths=[1, 2, 3, 40, 64, 5, 1, 7] * 6),
    "uint16-pad2": dict(vocab=3000, pad_multiple=2, max_seq_len=96, lengths=[1] * 40 + [3, 95, 17, 2] * 5),
    "uint32-pad8": dict(vocab=150_000, pad_multiple=8, max_seq_len=128, lengths=[9, 1, 120, 33, 8, 64, 2] * 5),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def synth(request, tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("batched") / request.param, **CASES[request.param])


def check_batches(ds: PrepackedDataset, seed: int = 0) -> None:
    n = len(ds)
    rng = np.random.default_rng(seed)
    picks = [
        np.arange(n),  # everything at once
        [0],
        [n - 1, 0, n - 1],  # repeats
        [-1, -n],  # negative positions, as ds[i] takes them
        *(rng.integers(0, n, k) for k in (2, 3, 8, 8)),
    ]
    for idx in picks:
        assert_same(ds.batch(idx), rowwise(ds, idx))
        got = ds.__getitems__(list(idx))
        assert isinstance(got, BatchedRows) and len(got) == len(idx)
        assert_same(ds.collate(got), rowwise(ds, idx))
        for k, i in enumerate(idx):  # the rows a generic collate_fn iterates over
            assert_same(got[k], ds[int(i)])
    rows = ds.epoch_rows()[: min(n, 5)][::-1]
    assert_same(ds.read_rows(rows), PackedBatch.concat([ds.row(int(r)) for r in rows]))


def test_the_batched_read_equals_row_by_row_for_every_dtype_and_pad_multiple(synth):
    for verify in ("full", None):
        ds = PrepackedDataset(synth, verify=verify)
        assert ds.manifest["token_dtype"] in ("uint8", "uint16", "uint32")
        assert ds.tokens.dtype == np.dtype(ds.manifest["token_dtype"])
        assert ds.manifest["counts"]["max_sequences_per_row"] >= 8  # rows of many sequences (44 with pad 2)
        check_batches(ds)


def test_the_batched_read_equals_row_by_row_on_real_conversations_in_any_epoch_order(built):
    """The shared prepack: chat conversations, pad multiple 4, split pieces, plain string ids."""
    out = built[1]
    check_batches(PrepackedDataset(out))
    for world, rank in ((1, 0), (2, 1)):
        ds = PrepackedDataset(out, shuffle=True, seed=11, rank=rank, world_size=world)
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            check_batches(ds, seed=epoch)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_reads_batches_in_one_pass_with_any_collate(built, workers):
    ds = PrepackedDataset(built[1], shuffle=True, seed=3)
    ds.set_epoch(1)
    order = list(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(5)))
    sampler = torch.utils.data.BatchSampler(order, batch_size=3, drop_last=False)
    want = [rowwise(ds, b) for b in sampler]
    assert len(want) > 1
    for collate_fn in (ds.collate, PackedBatch.concat):  # the fast path, and a collate that iterates
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=collate_fn)
        got = list(loader)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)


def test_a_pickled_dataset_reads_the_same_batches(synth):
    ds = PrepackedDataset(synth)
    again = pickle.loads(pickle.dumps(ds))
    idx = np.arange(len(ds))[::-1]
    assert_same(again.batch(idx), ds.batch(idx))


def test_bad_indices_are_refused_like_row_by_row(synth):
    ds = PrepackedDataset(synth)
    n = len(ds)
    for bad in ([0, n], [-n - 1]):
        with pytest.raises(IndexError, match=rf"row -?\d+ is out of range for {n} rows"):
            ds.batch(bad)
    with pytest.raises(IndexError, match=rf"out of range for {ds.num_rows} rows"):
        ds.read_rows([ds.num_rows])
    with pytest.raises(ValueError, match="at least one row"):
        ds.batch([])


def test_a_damaged_index_read_unverified_gives_the_row_readers_error(synth, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(synth, copy)
    seqs = np.load(copy / "sequences.npy")
    seqs["length"][0] += 1  # row 0 now claims one token more than it holds: same file size
    np.save(copy / "sequences.npy", seqs)
    ds = PrepackedDataset(copy, verify=None)  # no index checks: the read itself must refuse
    with pytest.raises(PrepackError, match="row 0 cannot be read") as by_row:
        ds[0]
    with pytest.raises(PrepackError, match="row 0 cannot be read") as batched:
        ds.batch([1, 0])
    assert str(batched.value) == str(by_row.value)
    assert_same(ds.batch([1]), ds[1])  # the other rows still read
    with pytest.raises(PrepackError, match="sequences.npy does not match its checksum"):
        PrepackedDataset(copy)  # and the default check names the file


def outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever the row reader raises, the batched read must raise alike
        return "error", (type(e), str(e))


def test_random_damage_to_the_index_reads_alike_batched_and_row_by_row(tmp_path):
    """Flipped bytes in the index files, opened unchecked (verify=None): every row and the whole
    epoch either read the same batched and row by row, or fail with the same error (the compiled
    pass checks every offset before it reads, so garbage never reaches memory outside the files)."""
    out = synthetic(tmp_path / "d", **CASES["uint8-pad1"])
    rng = np.random.default_rng(2)
    names = ("rows.npy", "sequences.npy", "conversation_offsets.npy", "conversation_ids.npy")
    originals = {name: (out / name).read_bytes() for name in names}
    starts = {name: len(originals[name]) - np.load(out / name).nbytes for name in names}  # past the header
    failed = 0
    for trial in range(80):
        name = names[trial % len(names)]
        data = bytearray(originals[name])
        at = int(rng.integers(starts[name], len(data)))
        data[at] ^= 1 << int(rng.integers(0, 8))
        (out / name).write_bytes(bytes(data))
        ds = PrepackedDataset(out, verify=None)
        for idx in [[i] for i in range(len(ds))] + [list(range(len(ds)))]:
            a, b = outcome(ds.batch, idx), outcome(rowwise, ds, idx)
            assert a[0] == b[0], (name, at, idx, a, b)
            if a[0] == "ok":
                assert_same(a[1], b[1])
            else:
                assert a[1] == b[1]
                failed += 1
        (out / name).write_bytes(originals[name])
    assert failed > 0  # the damage was seen
