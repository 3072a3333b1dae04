"""Megatron-Bridge's packed Parquet: export sftpack rows to it, import its files.

Megatron-Bridge (NeMo's Megatron path) stores one packed row per Parquet row,
with exactly three columns::

    input_ids     list<int64>   the row's sequences end to end
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
- Bridge feeds each stored sequence's ``len - 1`` tokens (``seq[:-1]`` as
  inputs, ``seq[1:]`` as labels): its reader's ``cu_seqlens`` step by
  ``len - 1``, and its writer bounds ``sum(len_i - 1)`` by ``pack_size``. The
  metadata is in those units too: ``dataset_max_seqlen`` is the largest
  ``len - 1``, ``min_packed_seqlen`` the smallest row sum of ``len - 1``, and
  ``packing_efficiency`` counts ``len - 1`` per sequence. Bridge's reader with
  ``pad_cu_seqlens=True`` hands the attention kernel
  ``max(dataset_max_seqlen, max_length - min_packed_seqlen)`` as ``max_seqlen``,
  which bounds every segment (the row's trailing padding segment included) only
  when the metadata is in these units; the export writes them. sftpack lays all
  ``len`` tokens (the last one's label is -100) and bounds ``sum(len_i)``, so
  an exported row always fits ``pack_size = max_seq_len``; an imported row may
  need up to ``max_samples_per_bin`` more slots, so the import's default width
  is the widest row's need.
- Context parallelism: Bridge pads for CP in its *writer*
  (``pad_seq_to_mult``), never in its reader. Its writer rounds each sequence's
  ``len - 1`` up to the multiple by appending the tokenizer's EOS id (loss mask
  0 there, before the roll), so every ``cu_seqlens`` entry is a multiple. The
  export does the same for the prepack's pad multiple (or ``pad_multiple=``);
  it needs the EOS id, from ``tokenizer=``. The import takes ``seq_start_id`` as
  the truth (a padded file's EOS pads become untrained tokens of their
  sequence).
- Random access: Parquet decodes a whole row group (500 rows as Bridge writes
  it) to read one row; the prepack reads a row as two slices of a memory map.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .. import _optional
from .._base import positive_int
from .._types import Tokenizer
from ..data import default_tokenizer
from ..sample import Sample
from ._dataset import PrepackedDataset
from ._fingerprint import tokenizer_fingerprint
from ._plan import KeepRows
from ._prepack import prepack_rows
from ._result import PrepackResult

__all__ = ["export_megatron_bridge", "import_megatron_bridge"]


def _bridge_lengths(lengths: ArrayLike, pad_multiple: int = 1) -> np.ndarray:
    """Stored length of each sequence as Bridge's writer lays it for ``pad_seq_to_mult``.

    A sequence of ``L`` real tokens feeds ``L - 1`` (its runtime length); the
    writer rounds that up to ``pad_multiple`` and stores one token more::

        stored = ceil((L - 1) / m) * m + 1

    >>> _bridge_lengths([5, 6, 9, 1], 4).tolist()
    [5, 9, 9, 1]
    """
    m = positive_int("pad_multiple", pad_multiple)
    runtime = np.maximum(np.asarray(lengths, dtype=np.int64) - 1, 0)
    return -(-runtime // m) * m + 1


def _layout(lens: np.ndarray, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where a row's real tokens go in Bridge's stored layout: ``(seq_start_id, slot of every real token)``."""
    begin = np.zeros(stored.shape[0], np.int64)
    np.cumsum(stored[:-1], out=begin[1:])
    first = np.zeros(lens.shape[0], np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    return begin, np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(begin - first, lens)


def _pyarrow() -> tuple[Any, Any]:
    """``pyarrow`` and ``pyarrow.parquet`` (the ``chat`` extra's), through :mod:`sftpack._optional`."""
    pq = _optional.parquet()
    return sys.modules["pyarrow"], pq  # importing pyarrow.parquet imported pyarrow


def _prepack_tokenizer(ds: PrepackedDataset, tokenizer: Tokenizer | None, need: str, *, check: bool) -> Tokenizer:
    """``tokenizer``, or the prepack's own when it is sftpack's default tokenizer; ``check``:
    refuse a tokenizer other than the prepack's (its ids must mean what the prepack's mean)."""
    have = (ds.manifest["fingerprint"].get("tokenizer") or {}).get("sha256")
    if tokenizer is None:
        default = default_tokenizer()
        if have is None or tokenizer_fingerprint(default)["sha256"] != have:
            raise ValueError(
                f"{ds.path}: {need} needs a tokenizer, and the prepack was not made with sftpack's default one: "
                "pass tokenizer="
            )
        return default
    if check and have is not None and tokenizer_fingerprint(tokenizer)["sha256"] != have:
        raise ValueError(
            f"{ds.path} was prepacked with another tokenizer (fingerprint {have[:12]}) than tokenizer= "
            f"({tokenizer_fingerprint(tokenizer)['sha256'][:12]}): pass the prepack's tokenizer"
        )
    return tokenizer


def _eos_id(ds: PrepackedDataset, tokenizer: Tokenizer | None) -> int:
    """The EOS id Bridge's writer pads with (its ``tokenizer.eod``)."""
    need = "padding for context parallelism (Bridge's writer pads with the EOS id; pad_multiple=1 does not pad)"
    tokenizer = _prepack_tokenizer(ds, tokenizer, need, check=True)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or eos < 0:
        raise ValueError(f"tokenizer= has no EOS token (eos_token_id={eos!r}): Bridge's writer pads with it")
    return eos


def export_megatron_bridge(
    dataset: PrepackedDataset | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    split: str = "training",
    row_group_size: int = 500,
    pad_multiple: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a prepack's rows as Megatron-Bridge packed Parquet; returns the Parquet path.

    Args:
        dataset: a :class:`~sftpack.offline.PrepackedDataset` or its directory.
        out_dir: folder for ``{split}_{pack_size}.idx.parquet`` and ``{pack_size}_metadata.jsonl``.
        split: ``"training"``, ``"validation"`` or ``"test"``.
        row_group_size: rows per Parquet row group (Bridge writes 500).
        pad_multiple: Bridge's ``pad_seq_to_mult`` (``2 * context_parallel_size``): each
            sequence is padded as Bridge's writer pads it (``ceil((len - 1) / m) * m + 1`` tokens, EOS
            tokens, loss mask 0). ``None``: the prepack's pad multiple; 1: no padding.
        tokenizer: the prepack's tokenizer, for its EOS id; needed when padding, unless
            the prepack was made with sftpack's default tokenizer.

    Raises:
        ValueError: a row that does not fit ``pack_size`` once padded to ``pad_multiple``
            (only for a multiple other than the prepack's), or no EOS id to pad with.
    """
    pa, pq = _pyarrow()
    ds = dataset if isinstance(dataset, PrepackedDataset) else PrepackedDataset(dataset)
    m = ds.pad_multiple if pad_multiple is None else positive_int("pad_multiple", pad_multiple)
    pack_size = ds.max_seq_len
    rows = ds.rows
    seq_off = rows["sequence"].astype(np.int64)
    real = ds.sequences["length"].astype(np.int64)
    stored_all = _bridge_lengths(real, m)
    runtime_all = stored_all - 1
    per_row = np.diff(seq_off)
    loads = np.add.reduceat(runtime_all, seq_off[:-1]) if real.shape[0] else np.zeros(0, np.int64)
    if loads.shape[0] and int(loads.max()) > pack_size:
        r = int(np.argmax(loads))
        raise ValueError(
            f"{ds.path} row {r} needs {int(loads[r])} slots once its sequences are padded to pad_multiple={m} as "
            f"Bridge's writer pads them, more than pack_size={pack_size}: prepack with --pad-multiple {m} "
            f"(then every row fits) or export with pad_multiple={ds.pad_multiple}"
        )
    eos = _eos_id(ds, tokenizer) if m > 1 else 0

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}_{pack_size}.idx.parquet"
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("seq_start_id", pa.list_(pa.int64())),
        ]
    )
    with pq.ParquetWriter(path, schema) as writer:
        for a in range(0, ds.num_rows, row_group_size):
            b = min(a + row_group_size, ds.num_rows)
            ids, masks, starts = [], [], []
            for r in range(a, b):
                tok, mask, _ = ds.row_arrays(r)
                lens = real[seq_off[r] : seq_off[r + 1]]
                stored = stored_all[seq_off[r] : seq_off[r + 1]]
                begin, at = _layout(lens, stored)
                row_ids = np.full(int(stored.sum()), eos, np.int64)  # the pads: Bridge's writer uses EOS
                row_ids[at] = tok
                per_token = np.zeros(row_ids.shape[0], np.int8)  # pads: mask 0, as the writer pads it
                per_token[at] = mask
                rolled = np.zeros_like(per_token)  # Bridge's target mask: rolled[t] = mask[t+1] ...
                rolled[:-1] = per_token[1:]
                rolled[begin + stored - 1] = 0  # ... and 0 on each sequence's last slot
                ids.append(row_ids)
                masks.append(rolled)
                starts.append(begin)
            table = pa.table(
                [
                    pa.array(ids, pa.list_(pa.int64())),
                    pa.array(masks, pa.list_(pa.int8())),
                    pa.array(starts, pa.list_(pa.int64())),
                ],
                schema=schema,
            )
            writer.write_table(table, row_group_size=row_group_size)
    n_rows, n_seqs = ds.num_rows, int(real.shape[0])
    meta = {  # Bridge's units: a sequence counts its runtime length, stored len - 1
        "dataset_max_seqlen": int(runtime_all.max()) if n_seqs else 0,
        "max_samples_per_bin": int(per_row.max()) if n_rows else 0,
        "packing_factor": round(n_seqs / max(n_rows, 1), 2),
        "packing_efficiency": round(100.0 * int(runtime_all.sum()) / max(n_rows * pack_size, 1), 2),
        "pack_size": pack_size,
        "min_packed_seqlen": int(loads.min()) if n_rows and n_seqs else 0,
    }
    meta_path = out / f"{pack_size}_metadata.jsonl"
    entries = json.loads(meta_path.read_text()) if meta_path.exists() else []
    entries = [e for e in entries if e.get("split") != split] + [dict(meta, split=split)]
    meta_path.write_text(json.dumps(entries, indent=1) + "\n")
    return path


def _bridge_rows(path: Path) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    _, pq = _pyarrow()
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
    tokenizer: Tokenizer | None = None,
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
    rows = (_row_samples(path, r, ids, lm, st) for r, (ids, lm, st) in enumerate(_bridge_rows(path)))
    planner = KeepRows(None, max_seq_len, pad_multiple)
    kind = "megatron_bridge_parquet"
    return prepack_rows(
        rows, out, planner, tokenizer=tokenizer, source=path, source_kind=kind, overwrite=overwrite, progress=progress
    )
