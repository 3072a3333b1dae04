"""The Megatron-Bridge export read the way Bridge's own code reads and writes it.

Nothing here calls sftpack to say what Bridge expects. The expectations are
written in this file from Bridge's published code (``GPTSFTPackedDataset.collate_fn``
and ``packing_utils.create_packing_strategy`` / ``packed_sequence.tokenize_dataset``
in megatron/bridge/data/datasets), in our own words:

- the reader turns a stored sequence of ``n`` tokens into a ``cu_seqlens`` step of
  ``n - 1`` (``input_ids[start:end-1]`` as inputs, ``input_ids[start+1:end]`` as
  labels), then appends ``max_length`` when the row is shorter (one trailing
  padding segment);
- with ``pad_cu_seqlens=True`` it hands the kernel ``max_seqlen =
  max(dataset_max_seqlen, max_length - min_packed_seqlen)`` from the metadata, where
  the writer defines ``dataset_max_seqlen`` as the largest ``n - 1`` and
  ``min_packed_seqlen`` as the smallest row sum of ``n - 1``;
- for context parallelism (``pad_seq_to_mult = m``) the writer pads each tokenized
  sequence before packing: its runtime length ``n - 1`` is rounded up to ``m``
  (capped at ``max_seq_length // m * m``) and one more token is stored, the new
  ``input_ids`` being the tokenizer's EOS (its ``eod``) and the new per-token
  ``loss_mask`` 0; the packer then rolls each sequence's mask by one
  (``mask[1:] + [0]``) and records ``seq_start_id``.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from sftpack.data import default_corpus
from sftpack.offline import PrepackedDataset, export_megatron_bridge, prepack

from .conftest import MAX_SEQ_LEN


def _read(path):
    t = pq.read_table(path)
    return [
        (np.asarray(a, np.int64), np.asarray(b, np.int64), np.asarray(c, np.int64))
        for a, b, c in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist(), t["seq_start_id"].to_pylist())
    ]


def _reader_cu_seqlens(ids, starts, max_length):
    """Bridge's collate: one segment of ``n - 1`` per stored sequence, then the padding segment."""
    bounds = np.append(starts, ids.shape[0])
    cu = [0]
    for n in np.diff(bounds):
        cu.append(cu[-1] + int(n) - 1)
    assert cu[-1] <= max_length  # the reader asserts this too
    real_end = cu[-1]
    if real_end != max_length:
        cu.append(max_length)
    return np.asarray(cu), real_end


def _kernel_max_seqlen(entries, max_length):
    """``max_seqlen`` that Bridge's collate passes with ``pad_cu_seqlens=True`` (all splits' metadata)."""
    dataset_max = max(e["dataset_max_seqlen"] for e in entries)
    min_packed = min(e["min_packed_seqlen"] for e in entries)
    return max(dataset_max, max_length - min_packed)


def _writer_row(seqs, eos, m, max_seq_length):
    """What Bridge's writer stores for a row of (tokens, per-token mask) sequences with pad_seq_to_mult=m."""
    ids, lm, starts = [], [], []
    cap = max_seq_length // m * m
    for tokens, mask in seqs:
        runtime = max(len(tokens) - 1, 0)
        target = min(cap, -(-runtime // m) * m) if m > 1 else runtime
        stored = target + 1
        t = list(tokens) + [eos] * (stored - len(tokens))
        k = [int(x) for x in mask] + [0] * (stored - len(mask))
        starts.append(len(ids))
        ids += t
        lm += k[1:] + [0]
    return np.asarray(ids), np.asarray(lm), np.asarray(starts)


def _prepack_sequences(ds, r):
    """Row ``r``'s sequences as (real tokens, per-token mask), read from the prepack's files."""
    tok, mask, seqs = ds.row_arrays(r)
    out, at = [], 0
    for n in seqs["length"]:
        out.append((tok[at : at + n].tolist(), mask[at : at + n].tolist()))
        at += int(n)
    return out


@pytest.fixture(scope="module")
def unpadded(tok, tmp_path_factory):
    """A prepack with pad multiple 1 (the `built` one has 4) of short conversations (each one's
    first exchange), whose lightest row leaves a padding segment longer than any conversation."""
    d = tmp_path_factory.mktemp("bridge")
    src = d / "short.jsonl"
    src.write_text("".join(json.dumps({"messages": c.messages[:2]}) + "\n" for c in default_corpus(limit=60)))
    return prepack(src, d / "p", tokenizer=tok, max_seq_len=MAX_SEQ_LEN, overlong="drop").path


@pytest.mark.parametrize("source, m", [("unpadded", 1), ("built", 4), ("built", 1)])
def test_metadata_is_in_bridges_units_and_bounds_every_segment(source, m, request, tok, tmp_path):
    src = request.getfixturevalue(source)
    ds = PrepackedDataset(src[1] if source == "built" else src)
    path = export_megatron_bridge(ds, tmp_path, pad_multiple=m, tokenizer=tok)
    entries = json.loads((tmp_path / f"{ds.max_seq_len}_metadata.jsonl").read_text())
    meta = entries[0]
    rows = _read(path)
    pack_size = max_length = meta["pack_size"]  # Bridge packs and reads at pack_size (pad_to_max_length)
    assert pack_size == ds.max_seq_len and len(rows) == len(ds)
    runtimes = [np.diff(np.append(st, ids.shape[0])) - 1 for ids, _, st in rows]
    # the writer's definitions, recomputed from the file
    assert meta["dataset_max_seqlen"] == max(int(r.max()) for r in runtimes)
    assert meta["min_packed_seqlen"] == min(int(r.sum()) for r in runtimes)
    assert meta["max_samples_per_bin"] == max(r.shape[0] for r in runtimes)
    total = sum(int(r.sum()) for r in runtimes)
    assert meta["packing_efficiency"] == round(total / len(rows) / pack_size * 100, 2)
    assert meta["packing_factor"] == round(sum(r.shape[0] for r in runtimes) / len(rows), 2)
    # the reader: the kernel's max_seqlen covers every segment of every row, the padding one included
    bound = _kernel_max_seqlen(entries, max_length)
    longest = 0
    for ids, _, st in rows:
        cu, _ = _reader_cu_seqlens(ids, st, max_length)
        longest = max(longest, int(np.diff(cu).max()))
    assert bound >= longest
    if source == "unpadded":
        # the old export's metadata (full lengths n, row sums of n) under-reports on this data:
        # the guard above is what failed before the fix
        full_max = max(int((r + 1).max()) for r in runtimes)
        full_min = min(int((r + 1).sum()) for r in runtimes)
        assert max(full_max, max_length - full_min) < longest


def test_cp_export_is_what_bridges_writer_writes(built, tok, tmp_path):
    ds = PrepackedDataset(built[1])
    m = ds.pad_multiple
    assert m == 4
    path = export_megatron_bridge(ds, tmp_path, tokenizer=tok)  # the prepack's multiple by default
    rows = _read(path)
    eos = tok.convert_tokens_to_ids(tok.eos_token)  # Bridge's HF tokenizer: eod = id of the EOS token
    for r, (ids, lm, st) in enumerate(rows):
        want_ids, want_lm, want_st = _writer_row(_prepack_sequences(ds, r), eos, m, ds.max_seq_len)
        assert ids.tolist() == want_ids.tolist() and lm.tolist() == want_lm.tolist()
        assert st.tolist() == want_st.tolist()
        cu, real_end = _reader_cu_seqlens(ids, st, ds.max_seq_len)
        assert np.all(cu % m == 0), f"row {r}: a segment starts off the multiple {m}"
        # the reader's unpadded lengths (up to the last non-EOS input) keep every trained label
        bounds = np.append(st, ids.shape[0])
        for a, b in zip(bounds[:-1], bounds[1:]):
            inputs = ids[a : b - 1]
            non_eos = np.flatnonzero(inputs != eos)
            unpadded = int(non_eos[-1]) + 1 if non_eos.shape[0] else 0
            trained = np.flatnonzero(lm[a : b - 1])
            assert trained.shape[0] == 0 or int(trained[-1]) < unpadded
    # labels: the trained (input, label) pairs are the prepack's, nothing added by the pads
    for r in (0, len(ds) - 1):
        ids, lm, st = rows[r]
        got = [(int(ids[t]), int(ids[t + 1])) for t in np.flatnonzero(lm)]
        row = ds.row(r)
        keep = row.labels != -100
        want = list(zip(row.input_ids[keep].tolist(), row.labels[keep].tolist()))
        assert got == want


def test_unpadded_export_of_a_cp_prepack_is_what_the_bug_looked_like(built, tok, tmp_path):
    """pad_multiple=1 writes real tokens only: a CP reader then sees most segments unaligned."""
    ds = PrepackedDataset(built[1])
    rows = _read(export_megatron_bridge(ds, tmp_path, pad_multiple=1))
    # every segment after a row's first (which starts at 0 anyway)
    starts = np.concatenate([_reader_cu_seqlens(ids, st, ds.max_seq_len)[0][1:-1] for ids, _, st in rows])
    assert np.count_nonzero(starts % ds.pad_multiple) > len(starts) // 2


def test_export_refuses_what_it_cannot_write(built, unpadded, tok, tmp_path):
    ds = PrepackedDataset(unpadded)
    with pytest.raises(ValueError, match=r"row \d+ needs \d+ slots .* pad_multiple=256 .* --pad-multiple 256"):
        export_megatron_bridge(ds, tmp_path / "wide", pad_multiple=256, tokenizer=tok)
    with pytest.raises(ValueError, match=r"EOS id.*pass tokenizer="):
        export_megatron_bridge(built[1], tmp_path / "noeos")  # the tiny tokenizer is not the default one
    from sftpack.testing import tiny_chat_tokenizer

    with pytest.raises(ValueError, match="another tokenizer"):
        export_megatron_bridge(built[1], tmp_path / "other", tokenizer=tiny_chat_tokenizer("llama3"))
    assert not any((tmp_path / d).exists() for d in ("wide", "noeos", "other"))
