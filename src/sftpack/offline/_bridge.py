"""Megatron-Bridge's packed Parquet: export sftpack rows to it, import its files.

Megatron-Bridge (NeMo's Megatron path) stores one packed row per Parquet row,
with exactly three columns::

    input_ids     list<int64>   the row's sequences end to end, no padding
    loss_mask     list<int8>    ROLLED by one: loss_mask[t] = mask[t + 1]; 0 on each sequence's last token
    seq_start_id  list<int64>   start of each sequence (from 0, no end entry)

in ``{split}_{pack_size}.idx.parquet`` (row groups of 500 rows) beside
``{pack_size}_metadata.jsonl``, a JSON *array* with one dict per split
(``dataset_max_seqlen``, ``max_samples_per_bin``, ``packing_factor``,
``packing_efficiency``, ``pack_size``, ``min_packed_seqlen``).

What differs from a prepack, and what the conversion keeps:

- Bridge's loss mask is already the *target* mask (``loss_mask[t]`` says
  whether the label of slot ``t``, token ``t+1``, is trained); sftpack's is per
  token. Exporting rolls ours by one within each sequence; importing unrolls
  it (a sequence's first token, never a target, gets False). Labels are equal
  both ways.
- Bridge feeds each sequence's ``len - 1`` tokens (``seq[:-1]`` as inputs,
  ``seq[1:]`` as labels) and bounds ``sum(len_i - 1)`` by ``pack_size``; sftpack
  lays all ``len`` tokens (the last one's label is -100) and bounds
  ``sum(len_i)``. An exported row therefore always fits Bridge's ``pack_size =
  max_seq_len``; an imported row may need up to ``max_samples_per_bin`` more
  slots, so the import's default width is the widest row's need.
- Bridge pads for context parallelism itself (pre-padding with EOS and
  recovering lengths by scanning back for the last non-EOS token, which
  shortens content that really ends in EOS); the export writes real tokens
  only and leaves sftpack's pad multiple out, the import takes ``seq_start_id``
  as the truth.
- Random access: Parquet decodes a whole row group per row (about 40 ms per
  row at 500 rows a group), the prepack reads a row in microseconds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..handoff import Sample
from ._prepack import PrepackResult, prepack_samples

__all__ = ["export_megatron_bridge", "import_megatron_bridge"]


def _rolled(mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per-token mask -> Bridge's target mask: ``out[t] = mask[t+1]``, 0 at each sequence's end."""
    out = np.zeros(mask.shape[0], np.int8)
    out[:-1] = mask[1:]
    out[np.cumsum(lengths) - 1] = 0
    return out


def export_megatron_bridge(
    dataset: Any,
    out_dir: str | os.PathLike[str],
    *,
    split: str = "training",
    row_group_size: int = 500,
) -> Path:
    """Write a prepack's rows as Megatron-Bridge packed Parquet; returns the Parquet path.

    Args:
        dataset: a :class:`~sftpack.offline.PrepackedDataset` or its directory.
        out_dir: folder for ``{split}_{pack_size}.idx.parquet`` and ``{pack_size}_metadata.jsonl``.
        split: ``"training"``, ``"validation"`` or ``"test"``.
        row_group_size: rows per Parquet row group (Bridge writes 500).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ._dataset import PrepackedDataset

    ds = dataset if isinstance(dataset, PrepackedDataset) else PrepackedDataset(dataset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pack_size = ds.max_seq_len
    path = out / f"{split}_{pack_size}.idx.parquet"
    schema = pa.schema([
        ("input_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("seq_start_id", pa.list_(pa.int64())),
    ])
    rows = ds.rows
    with pq.ParquetWriter(path, schema) as writer:
        for a in range(0, ds.num_rows, row_group_size):
            b = min(a + row_group_size, ds.num_rows)
            ids, masks, starts = [], [], []
            for r in range(a, b):
                t0, t1 = int(rows[r]["token"]), int(rows[r + 1]["token"])
                seqs = ds.row_sequences(r)
                lens = seqs["length"].astype(np.int64)
                ids.append(np.asarray(ds.tokens[t0:t1], dtype=np.int64))
                masks.append(_rolled(np.asarray(ds.loss_mask[t0:t1]), lens))
                starts.append(seqs["start"].astype(np.int64) - t0)
            table = pa.table(
                [pa.array(ids, pa.list_(pa.int64())), pa.array(masks, pa.list_(pa.int8())),
                 pa.array(starts, pa.list_(pa.int64()))],
                schema=schema,
            )
            writer.write_table(table, row_group_size=row_group_size)
    totals = np.diff(rows["token"].astype(np.int64))
    per_row = np.diff(rows["sequence"].astype(np.int64))
    c = ds.manifest["counts"]
    meta = {
        "dataset_max_seqlen": int(ds.sequences["length"].max()) if ds.sequences.shape[0] else 0,
        "max_samples_per_bin": int(per_row.max()) if per_row.shape[0] else 0,
        "packing_factor": round(c["sequences"] / max(c["rows"], 1), 2),
        "packing_efficiency": round(100.0 * c["tokens"] / max(c["rows"] * pack_size, 1), 2),
        "pack_size": pack_size,
        "min_packed_seqlen": int(totals.min()) if totals.shape[0] else 0,
    }
    meta_path = out / f"{pack_size}_metadata.jsonl"
    entries = json.loads(meta_path.read_text()) if meta_path.exists() else []
    entries = [e for e in entries if e.get("split") != split] + [dict(meta, split=split)]
    meta_path.write_text(json.dumps(entries, indent=1) + "\n")
    return path


def _bridge_rows(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = set(pf.schema_arrow.names)
    missing = {"input_ids", "loss_mask", "seq_start_id"} - names
    if missing:
        raise ValueError(
            f"{path} is not Megatron-Bridge packed Parquet: no column(s) {sorted(missing)} (columns: {sorted(names)})"
        )
    for batch in pf.iter_batches(columns=["input_ids", "loss_mask", "seq_start_id"]):
        cols = batch.to_pydict()
        for ids, lm, st in zip(cols["input_ids"], cols["loss_mask"], cols["seq_start_id"]):
            yield np.asarray(ids, np.int64), np.asarray(lm, np.int8), np.asarray(st, np.int64)


def _row_samples(path: Path, r: int, ids: np.ndarray, lm: np.ndarray, st: np.ndarray) -> list[Sample]:
    n = ids.shape[0]
    where = f"{path.name} row {r}"
    if lm.shape[0] != n:
        raise ValueError(f"{where}: loss_mask has {lm.shape[0]} entries for {n} input_ids")
    if st.shape[0] == 0 or st[0] != 0 or np.any(np.diff(st) < 1) or st[-1] >= n:
        raise ValueError(f"{where}: seq_start_id {st.tolist()[:8]} must start at 0 and increase within {n} tokens")
    bounds = np.append(st, n)
    out = []
    for k in range(st.shape[0]):
        a, b = int(bounds[k]), int(bounds[k + 1])
        mask = np.zeros(b - a, bool)
        mask[1:] = lm[a : b - 1] != 0  # unroll: token t+1 is trained iff the label of slot t is
        out.append(Sample(ids[a:b], mask, f"{path.name}[{r}]#{k}"))
    return out


def import_megatron_bridge(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_seq_len: int | None = None,
    pad_multiple: int = 1,
    tokenizer: Any = None,
    overwrite: bool = False,
    progress: bool = False,
) -> PrepackResult:
    """Turn a Megatron-Bridge packed Parquet file into a prepack, one row per Parquet row.

    The pack membership is kept exactly (row ``r`` holds the sequences of Parquet
    row ``r``, in order); conversation ids are ``"{file}[{row}]#{k}"``.
    ``max_seq_len=None`` makes the rows as wide as the widest needs. ``tokenizer``
    (optional) is recorded in the fingerprint and sets the pad id.
    """
    path = Path(path)
    sizes: list[int] = []

    def samples() -> Iterator[Sample]:
        for r, (ids, lm, st) in enumerate(_bridge_rows(path)):
            row = _row_samples(path, r, ids, lm, st)
            sizes.append(len(row))
            yield from row

    from ._fingerprint import input_fingerprints

    # the samples stream first, then the plan reads the row sizes they recorded
    return prepack_samples(
        samples(),
        out,
        max_seq_len=max_seq_len,
        pad_multiple=pad_multiple,
        row_sizes=sizes,
        tokenizer=tokenizer,
        fingerprint={"inputs": input_fingerprints([path])},
        source_kind="megatron_bridge_parquet",
        overwrite=overwrite,
        progress=progress,
    )

