"""Megatron-Energon end to end: a JSONL of corpus conversations prepared as an Energon dataset,
packed by PackingTaskEncoder; rows equal PackingDataset's rule for the same buffers; save/restore
with get_savable_loader gives the remaining rows exactly (0 and 2 workers)."""

from __future__ import annotations

import json

import pytest
from megatron.energon import (
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    reraise_exception,
)
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.jsonl.crude_jsonl_dataset import CrudeJsonlDatasetFactory

from sftpack.chat import tokenize_conversation
from sftpack.data import default_corpus, default_tokenizer
from sftpack.loader import PackingDataset, PackingTaskEncoder
from sftpack.sample import Overlong, OverlongError

N, BUFFER, WIDTH, MULT = 60, 16, 2048, 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``energon prepare chats.jsonl`` (its Python call): writes the index next to the file."""
    convs = list(default_corpus(limit=N))
    path = tmp_path_factory.mktemp("energon") / "chats.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": i, "messages": c.messages}) + "\n" for i, c in enumerate(convs))
    assert CrudeJsonlDatasetFactory.prepare_dataset(EPath(str(path))) == N
    assert (path.parent / "chats.jsonl.idx").exists()
    return str(path), convs, default_tokenizer()


def _loader(path, tok, num_workers, overlong="truncate"):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, global_error_handler=reraise_exception)
    encoder = PackingTaskEncoder(tok, max_seq_len=WIDTH, pad_multiple=MULT, overlong=overlong)
    ds = get_train_dataset(
        path,
        worker_config=wc,
        batch_size=1,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    return get_savable_loader(ds)


def sig(b) -> tuple:
    return (
        b.input_ids.numpy().tobytes(),
        b.labels.numpy().tobytes(),
        b.cu_seqlens_padded.tolist(),
        b.cu_seqlens.tolist(),
        tuple(b.sequence_ids),
    )


def _run_with_save(loader, k):
    """All rows, and the state saved after row k (the run continues to the end: no slow teardown)."""
    rows, state = [], None
    for i, b in enumerate(loader):
        rows.append(sig(b.validate()))
        if i + 1 == k:
            state = loader.save_state_rank()
    return rows, state


def test_energon_rows_equal_the_packing_dataset_rule_and_resume_exactly(prepared):
    path, convs, tok = prepared
    rows, state = _run_with_save(_loader(path, tok, 0), k=5)
    assert all(len(r[0]) == WIDTH * 8 for r in rows)  # every row max_seq_len int64 slots
    ids = sorted(i for r in rows for i in r[4])
    assert ids == list(range(N))  # every conversation exactly once, none dropped by the selector

    # The same conversations in the same order through PackingDataset, each buffer packed whole.
    samples = [tokenize_conversation(c.messages, tok, conversation_id=i) for i, c in enumerate(convs)]
    ours = PackingDataset(
        samples, max_seq_len=WIDTH, buffer_size=BUFFER, pad_multiple=MULT, max_wait=0, overlong="truncate"
    )
    assert [sig(b) for b in ours] == rows

    again = _loader(path, tok, 0)
    again.restore_state_rank(state)
    assert [sig(b) for b in again] == rows[5:]


def test_energon_two_workers_resume_exactly(prepared):
    path, _, tok = prepared
    rows, state = _run_with_save(_loader(path, tok, 2), k=7)
    assert sorted(i for r in rows for i in r[4]) == list(range(N))
    again = _loader(path, tok, 2)
    again.restore_state_rank(state)
    assert [sig(b) for b in again] == rows[7:]


def test_energon_encoder_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="overlong='cut' is not valid: choose one of 'split', 'truncate', 'drop'"):
        PackingTaskEncoder(None, max_seq_len=64, overlong="cut")
    with pytest.raises(ValueError, match="max_seq_len=30 is not a multiple of pad_multiple=4"):
        PackingTaskEncoder(None, max_seq_len=30, pad_multiple=4)
    with pytest.raises(ValueError, match="PackingTaskEncoder: pad_id must be a non-negative integer, got -1"):
        PackingTaskEncoder(None, max_seq_len=64, pad_id=-1)


def test_energon_default_overlong_loses_nothing_unasked(prepared):
    """Every layer defaults to overlong='split'; Energon encodes one sample into one, so a conversation
    longer than a row is refused by name (conversation 11 of the corpus has 4,371 tokens) instead of being
    cut short silently; overlong='drop' leaves it out, and every other conversation is packed."""
    path, convs, tok = prepared
    with pytest.raises(
        OverlongError, match=r"conversation 11 has \d+ tokens, more than max_seq_len=2048.*cannot split"
    ):
        list(_loader(path, tok, 0, overlong=Overlong.SPLIT))
    long = {i for i, c in enumerate(convs) if len(tokenize_conversation(c.messages, tok)) > WIDTH}
    assert 11 in long
    kept = sorted(i for b in _loader(path, tok, 0, overlong="drop") for i in b.sequence_ids)
    assert kept == sorted(set(range(N)) - long)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_energon_restore_sample_rebuilds_each_batch_exactly(prepared, num_workers):
    """Energon's own contract (its tests assert it): ``loader.restore_sample(batch.__restore_key__)``
    re-reads the batch's samples and re-packs them into an equal batch. With batch_size=2 each batch
    holds two packed rows, so the key nests Energon's loader, batcher, packer and reader levels."""
    from sftpack import PackedBatch
    from sftpack.loader import EnergonPackedBatch

    path, _, tok = prepared
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, global_error_handler=reraise_exception)
    ds = get_train_dataset(
        path,
        worker_config=wc,
        batch_size=2,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=PackingTaskEncoder(tok, max_seq_len=WIDTH, pad_multiple=MULT, overlong="truncate"),
        repeat=False,
    )
    loader = get_savable_loader(ds)
    assert loader.can_restore_sample()
    batches = list(loader)
    assert len(batches) >= 4
    assert sorted(i for b in batches for i in b.sequence_ids) == list(range(N))
    for b in batches:
        assert isinstance(b, EnergonPackedBatch) and isinstance(b, PackedBatch)
        key = b.__restore_key__
        names = [k for k in key if isinstance(k, str)]  # the levels Energon's wrappers prepended
        assert names[0].endswith("SavableDatasetWrapper") and "BatchDataset" in names, key  # (Simple...: 0 workers)
        assert "PackingDataset" in str(key), key
        again = loader.restore_sample(key)
        assert sig(again.validate()) == sig(b)
        assert again.max_seqlen == b.max_seqlen and again.num_tokens in (WIDTH, 2 * WIDTH)
        assert again.__key__ == b.__key__ and len(b.__key__) == again.num_tokens // WIDTH
        assert again.__restore_key__ == key
    # Two different batches restore to two different batches (the key is not ignored).
    assert sig(loader.restore_sample(batches[1].__restore_key__)) != sig(batches[0])
