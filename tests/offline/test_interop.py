"""Megatron-Bridge packed Parquet and the upstream packed JSONL, both directions.

The files read here are written by the test itself straight from the published
formats (pyarrow for Parquet, json for JSONL), not by sftpack's exporters, so an
importer that merely mirrors our own exporter would fail."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from sftpack.chat import tokenize_conversation
from sftpack.data import default_corpus
from sftpack.offline import (
    PrepackedDataset,
    export_megatron_bridge,
    export_packed_jsonl,
    import_megatron_bridge,
    import_packed_jsonl,
    prepack,
)

# --------------------------------------------------------------------------- Megatron-Bridge


def _bridge_file(path, rows):
    """Write rows as Megatron-Bridge does: list<int64> input_ids, list<int8> loss_mask rolled by
    one (the target mask), list<int64> seq_start_id without an end entry, 500-row groups."""
    ids, lm, st = [], [], []
    for seqs in rows:  # seqs: list of (token ids, per-token trainable mask)
        row_ids, row_lm, starts = [], [], []
        for tokens, mask in seqs:
            starts.append(len(row_ids))
            row_ids += tokens
            row_lm += [int(m) for m in mask[1:]] + [0]  # loss_mask[t] = mask[t+1]; last token of a sequence: 0
        ids.append(row_ids)
        lm.append(row_lm)
        st.append(starts)
    table = pa.table(
        {
            "input_ids": pa.array(ids, pa.list_(pa.int64())),
            "loss_mask": pa.array(lm, pa.list_(pa.int8())),
            "seq_start_id": pa.array(st, pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, path, row_group_size=500)


def test_import_megatron_bridge_keeps_rows_and_labels(tmp_path):
    rows = [
        [([5, 6, 7, 8], [0, 0, 1, 1]), ([9, 10, 11], [0, 1, 1])],
        [([20, 21, 22, 23, 24, 25], [0, 0, 0, 1, 1, 1])],
    ]
    src = tmp_path / "training_8.idx.parquet"
    _bridge_file(src, rows)
    r = import_megatron_bridge(src, tmp_path / "imp")
    ds = PrepackedDataset(r.path, verify="full")
    assert len(ds) == 2 and r.manifest["source"] == "megatron_bridge_parquet"
    assert ds.max_seq_len == 7  # 4 + 3 tokens: Bridge's row exceeds pack_size 8 - 2 by design; width = need
    row = ds[0].validate()
    assert row.cu_seqlens.tolist() == [0, 4, 7] and row.sequence_ids == (
        "training_8.idx.parquet[0]#0",
        "training_8.idx.parquet[0]#1",
    )
    # labels: slot t targets token t+1 where Bridge's loss_mask[t] is 1, never across a boundary
    assert row.labels.tolist() == [-100, 7, 8, -100, 10, 11, -100]
    assert ds[1].labels.tolist()[:6] == [-100, -100, 23, 24, 25, -100]
    with pytest.raises(Exception, match="does not fit|more than max_seq_len"):
        import_megatron_bridge(src, tmp_path / "narrow", max_seq_len=6)


def test_export_megatron_bridge_follows_the_schema(built, tmp_path):
    ds = PrepackedDataset(built[1])
    path = export_megatron_bridge(ds, tmp_path / "mb", pad_multiple=1)  # no CP padding: real tokens only
    assert path.name == f"training_{ds.max_seq_len}.idx.parquet"
    pf = pq.ParquetFile(path)
    assert [str(t) for t in pf.schema_arrow.types] == [
        "list<element: int64>",
        "list<element: int8>",
        "list<element: int64>",
    ]
    assert pf.schema_arrow.names == ["input_ids", "loss_mask", "seq_start_id"]
    table = pf.read()
    assert table.num_rows == len(ds)
    for r in (0, len(ds) - 1):
        row = ds.row(r)
        ids = np.asarray(table["input_ids"][r].as_py())
        lm = np.asarray(table["loss_mask"][r].as_py())
        st = table["seq_start_id"][r].as_py()
        real = row.real_token_mask
        assert ids.tolist() == row.input_ids[real].tolist()  # real tokens only, no padding
        assert st == (row.cu_seqlens[:-1]).tolist()
        # Bridge's loss_mask is our labels' mask on real slots
        assert lm.tolist() == (row.labels[real] != -100).long().tolist()
    meta = json.loads((tmp_path / "mb" / f"{ds.max_seq_len}_metadata.jsonl").read_text())
    assert isinstance(meta, list) and meta[0]["pack_size"] == ds.max_seq_len
    assert meta[0]["max_samples_per_bin"] == int(np.diff(ds.rows["sequence"]).max())
    # and back: the same rows, labels and membership
    back = PrepackedDataset(
        import_megatron_bridge(path, tmp_path / "back", max_seq_len=ds.max_seq_len, pad_multiple=ds.pad_multiple).path
    )
    assert len(back) == len(ds)
    for r in (0, len(ds) // 2):
        a, b = ds.row(r), back.row(r)
        assert torch.equal(a.input_ids[a.real_token_mask], b.input_ids[b.real_token_mask])
        assert torch.equal(a.labels[a.labels != -100], b.labels[b.labels != -100])
        assert a.cu_seqlens.tolist() == b.cu_seqlens.tolist()


# --------------------------------------------------------------------------- packed JSONL


def test_import_packed_jsonl_keeps_one_row_per_line(tmp_path, tok):
    convs = [c.messages for c in default_corpus(limit=5)]
    sys_msg = {"role": "system", "content": "Be nice."}
    lines = [
        [sys_msg, *convs[0], sys_msg, *convs[1]],
        [sys_msg, *convs[2]],
        [sys_msg, *convs[3], sys_msg, *convs[4]],
    ]
    src = tmp_path / "train.jsonl.packed"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    r = import_packed_jsonl(src, tmp_path / "imp", tokenizer=tok, max_seq_len=8192)
    ds = PrepackedDataset(r.path)
    assert len(ds) == 3
    assert [ds.row(i).num_sequences for i in range(3)] == [2, 1, 2]
    row = ds.row(0)
    assert row.sequence_ids == ("train.jsonl.packed:1#0", "train.jsonl.packed:1#1")
    want = tokenize_conversation([sys_msg, *convs[1]], tok)
    s, n = row.cu_seqlens[1].item(), len(want)
    assert row.input_ids[s : s + n].tolist() == want.input_ids.tolist()
    with pytest.raises(Exception, match="more than max_seq_len=256"):
        import_packed_jsonl(src, tmp_path / "narrow", tokenizer=tok, max_seq_len=256)
    bad = tmp_path / "bad.jsonl.packed"
    bad.write_text(json.dumps({"messages": lines[1]}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl.packed:2: invalid JSON"):
        import_packed_jsonl(bad, tmp_path / "bad", tokenizer=tok)
    assert not (tmp_path / "bad").exists()


def test_export_packed_jsonl_writes_rows_our_importer_reads_back(chat_file, tok, tmp_path):
    out = prepack(chat_file, tmp_path / "p", tokenizer=tok, max_seq_len=2048, overlong="drop").path
    ds = PrepackedDataset(out)
    dst = tmp_path / "train.jsonl.packed"
    counts = export_packed_jsonl(ds, dst, tokenizer=tok)
    lines = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(lines) == counts["rows"] and counts["conversations"] == ds.manifest["counts"]["sequences"]
    per_line = []
    for line in lines:
        msgs = line["messages"]
        assert msgs[0]["role"] == "system" and msgs[-1]["role"] == "assistant"
        per_line.append(sum(m["role"] == "system" for m in msgs))  # conversations, split as upstream does
    assert sum(per_line) == counts["conversations"]
    # our importer reads it back with the same membership, every row within the width
    back = PrepackedDataset(import_packed_jsonl(dst, tmp_path / "back", tokenizer=tok, max_seq_len=2048).path)
    assert [back.row(i).num_sequences for i in range(len(back))] == per_line
    split = prepack(chat_file, tmp_path / "s", tokenizer=tok, max_seq_len=512, overlong="split").path
    with pytest.raises(ValueError, match="split into pieces"):
        export_packed_jsonl(split, tmp_path / "s.jsonl.packed", tokenizer=tok)
