"""An Energon state saved after a packing buffer's last row (or after the last batch) resumes exactly.

Before: with ``repeat=False`` and 10 samples in buffers of 8, a state saved after batch 2 (the end of
the first buffer) restored into three batches instead of one (the 8 samples emitted before the save
again, the 2 left twice); a state saved after the last batch restored into the whole epoch; a
shuffle buffer's last samples and each worker's last buffer likewise. Cause (Energon 7.4.1): the reader rolls its own state over to
the next epoch as soon as it runs out, which the packer hits while filling its buffer, before it
emits the rows it still holds; with ``repeat=False`` nothing saves that the reader had run out, and
the restored reader reads the epoch again. sftpack's ``EndOfData`` level saves it. The contract: a
state saved after batch k yields exactly batches k+1, k+2, ... of the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.energon")

from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, reraise_exception  # noqa: E402
from megatron.energon.epathlib import EPath  # noqa: E402
from megatron.energon.flavors.jsonl.crude_jsonl_dataset import CrudeJsonlDatasetFactory  # noqa: E402

from sftpack.data import default_corpus, default_tokenizer  # noqa: E402
from sftpack.loader import PackingTaskEncoder, StateError  # noqa: E402

BUFFER = 8


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """Two prepared JSONL datasets of corpus conversations (10 and 20), and the tokenizer."""
    convs = list(default_corpus(limit=20))
    paths = {}
    for n in (10, 20):
        path = tmp_path_factory.mktemp("resume") / f"chats{n}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "messages": c.messages}) + "\n" for i, c in enumerate(convs[:n])))
        assert CrudeJsonlDatasetFactory.prepare_dataset(EPath(str(path))) == n
        paths[n] = str(path)
    return paths, default_tokenizer()


def _text_loader(path, tok, num_workers=0, shuffle=None, **loader_kw):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, global_error_handler=reraise_exception)
    enc = PackingTaskEncoder(tok, max_seq_len=2048, pad_multiple=4, overlong="truncate")
    ds = get_train_dataset(
        path,
        worker_config=wc,
        batch_size=1,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=shuffle,
        max_samples_per_sequence=None,
        task_encoder=enc,
        repeat=False,
    )
    return get_savable_loader(ds, **loader_kw)


def _ids(batches) -> list[list]:
    return [list(b.sequence_ids) for b in batches]


def _run(loader, ks=()):
    """All batches, and {k: the state saved after batch k} (the run goes on to the end)."""
    batches, states = [], {}
    for i, b in enumerate(loader):
        batches.append(b)
        if i + 1 in ks:
            states[i + 1] = loader.save_state_rank()
    return batches, states


def _levels(state, name):
    """Every level of an Energon state tree whose class is ``name``."""
    if isinstance(state, dict):
        found = [state] if state.get("__class__") == name else []
        return found + [x for v in state.values() for x in _levels(v, name)]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in _levels(v, name)]
    return []


def test_text_resumes_exactly_after_the_first_buffer_and_after_the_last_batch(chats):
    paths, tok = chats
    batches, states = _run(_text_loader(paths[10], tok), (1, 2, 3))
    full = _ids(batches)
    # 10 samples, buffer 8: the first buffer makes rows 1-2, the last 2 samples row 3.
    assert len(full) == 3 and sorted(i for r in full for i in r) == list(range(10))
    assert sorted(full[2]) == [8, 9]
    for k, state in states.items():
        if k >= 2:  # the packer had read the source to its end when the state was saved
            assert [s["_ended"] for s in _levels(state.worker_states, "EndOfData")] == [True]
        again = _text_loader(paths[10], tok)
        again.restore_state_rank(state)
        assert _ids(again) == full[k:], f"restored after batch {k}"
        if k == 3:  # the next pass over a finished loader is a new epoch, as it was
            assert _ids(again) == full


def test_text_resumes_exactly_at_each_workers_buffer_end(chats):
    """2 workers, 10 samples each: each worker's packer reaches its end before its last rows.

    A worker checkpoint at every batch: with Energon's default (the first batch, then each 60 s), a
    worker's state is an older checkpoint plus batches to skip, and a worker that skips to its end
    restarts its iterator (Energon's replay, timing-dependent: whether the worker had stored its final
    checkpoint when the state was saved), which this test does not cover."""
    paths, tok = chats
    every = {"checkpoint_every_sec": 0, "checkpoint_every_min_n_samples": 1}
    batches, states = _run(_text_loader(paths[20], tok, num_workers=2, **every), (5, 8))
    full = _ids(batches)
    assert len(full) == 8 and sorted(i for r in full for i in r) == list(range(20))
    for k, state in states.items():
        again = _text_loader(paths[20], tok, num_workers=2, **every)
        again.restore_state_rank(state)
        assert _ids(again) == full[k:], f"restored after batch {k}"


def test_text_resumes_exactly_through_a_shuffle_buffer(chats):
    """The shuffle buffer reaches the reader's end before it emits its last samples, too."""
    paths, tok = chats
    batches, states = _run(_text_loader(paths[10], tok, shuffle=4), (1, 2, 3))
    full = _ids(batches)
    assert len(full) == 3
    for k, state in states.items():
        again = _text_loader(paths[10], tok, shuffle=4)
        again.restore_state_rank(state)
        assert _ids(again) == full[k:], f"restored after batch {k}"


def test_a_state_saved_before_end_of_data_is_refused_by_name(chats):
    paths, tok = chats
    _, states = _run(_text_loader(paths[10], tok), (1,))
    state = states[1]
    (check,) = _levels(state.worker_states, "StateCheck")
    check["_version"] = 1
    with pytest.raises(StateError, match=r"sftpack StateCheck is version 1; this sftpack reads version 2"):
        _text_loader(paths[10], tok).restore_state_rank(state)


# ------------------------------------------------------------------ multimodal: the reported case
@pytest.fixture(scope="module")
def vqa_path(tmp_path_factory):
    pytest.importorskip("easy_vqa")
    from sftpack.multimodal import vqa_corpus
    from tests.loader.test_state_mismatch import _energon_shard

    convs = list(vqa_corpus(seed=2, limit=10, min_side=56, max_side=112))
    return _energon_shard(tmp_path_factory.mktemp("resume_mm") / "vqa", convs)


def test_multimodal_resumes_exactly_after_the_first_buffer_and_after_the_last_batch(vqa_path):
    """10 samples, buffer 8, max_seq_len=384: saved after batch 2, the restore gave 3 batches."""
    from tests.loader.test_energon_media import sig
    from tests.loader.test_state_mismatch import _mm_loader

    full, states = _run(_mm_loader(vqa_path, max_seq_len=384), (2, 3))
    assert len(full) == 3
    for k, state in states.items():
        again = _mm_loader(vqa_path, max_seq_len=384)
        again.restore_state_rank(state)
        assert [sig(b) for b in again] == [sig(b) for b in full[k:]], f"restored after batch {k}"
