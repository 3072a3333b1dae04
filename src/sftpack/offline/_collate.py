"""The compiled pass behind :meth:`PrepackedDataset.batch`: several rows laid end to end at once.

:func:`collate_rows` reads each row's tokens and loss mask straight out of the
memory-mapped arrays and writes the batch's five fields in one loop over the
slots, with the layout of :func:`sftpack.handoff.layout.lay_row` (each
sequence padded to the pad multiple, the row's tail folded into its last
segment, labels shifted within each sequence) and the offsets of
:meth:`sftpack.PackedBatch.concat` (rows end to end). It also gathers the raw
bytes of every sequence's conversation id, so the caller decodes them from one
buffer.

It first checks what the index promises (rows, sequences, tokens and ids in
range, lengths >= 1 that add up to the row's tokens, padded sequences that fit
the row): a damaged index read with ``verify=None`` returns a nonzero status and
no batch, and the caller falls back to the row-by-row reader, whose error names
the file.

Compiling is lazy: importing this module does not import numba; :func:`load`
makes :func:`collate_rows` a numba dispatcher (``cache=True``: later processes,
DataLoader workers included, load it from numba's on-disk cache), compiled on
its first call. It reads the token ids as little-endian bytes, so one
compiled kernel serves every token dtype (a kernel per dtype cost a compile
each). The loops are written plainly (no slice assignments) for a short
compile.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["IGNORE", "OK", "collate_rows", "load"]

OK = 0
IGNORE = -100  # sftpack.sample.IGNORE_INDEX (checked equal by the dataset module)

_lock = threading.Lock()
_compiled: Any = None


def _check(n_tok: int, index: tuple[Any, ...], rows: Any, width: int, m: int) -> tuple[int, int, int]:
    """``(status, sequences, id bytes)`` of the batch; status 0 when every row reads cleanly."""
    row_seq, row_tok, seq_len, seq_conv, conv_offs, conv_blob = index
    n_rows = row_seq.shape[0] - 1
    n_seq = seq_len.shape[0]
    n_conv = conv_offs.shape[0] - 1
    n_blob = conv_blob.shape[0]
    total_seq = 0
    id_bytes = 0
    for b in range(rows.shape[0]):
        r = rows[b]
        if r < 0 or r >= n_rows:
            return 1, 0, 0
        s0 = row_seq[r]
        s1 = row_seq[r + 1]
        if s0 < 0 or s1 <= s0 or s1 > n_seq:
            return 2, 0, 0
        t0 = row_tok[r]
        t1 = row_tok[r + 1]
        if t0 < 0 or t1 < t0 or t1 > n_tok:
            return 3, 0, 0
        real = 0
        padded = 0
        for s in range(s0, s1):
            n = np.int64(seq_len[s])
            if n < 1:
                return 4, 0, 0
            real += n
            padded += (n + m - 1) // m * m
            c = seq_conv[s]
            if c < 0 or c >= n_conv:
                return 5, 0, 0
            a = conv_offs[c]
            e = conv_offs[c + 1]
            if a < 0 or e < a or e > n_blob:
                return 6, 0, 0
            id_bytes += e - a
        if real != t1 - t0:
            return 7, 0, 0
        if padded > width:
            return 8, 0, 0
        total_seq += s1 - s0
    return OK, total_seq, id_bytes


def _collate_rows(
    tokens: Any, isz: int, mask: Any, index: tuple[Any, ...], rows: Any, width: int, m: int, pad_id: int
) -> tuple[int, Any, Any, Any, Any, Any, int, Any, Any, Any, Any]:
    status, n_out, id_bytes = _check(mask.shape[0], index, rows, width, m)
    row_seq, row_tok, seq_len, seq_conv, conv_offs, conv_blob = index
    n_slots = rows.shape[0] * width
    if status != OK:
        n_slots = 0
        n_out = 0
        id_bytes = 0
    ids = np.empty(n_slots, np.int64)
    labels = np.empty(n_slots, np.int64)
    pos = np.empty(n_slots, np.int64)
    cu = np.zeros(n_out + 1, np.int32)
    cup = np.zeros(n_out + 1, np.int32)
    conv = np.empty(n_out, np.int64)
    id_buf = np.empty(id_bytes, np.uint8)
    id_bounds = np.zeros(n_out + 1, np.int64)
    plain = np.zeros(n_out, np.uint8)
    max_seqlen = 0
    if status != OK:
        return status, ids, labels, pos, cu, cup, max_seqlen, conv, id_buf, id_bounds, plain
    si = 0
    real_off = 0
    q = 0  # next byte of id_buf
    for b in range(rows.shape[0]):
        r = rows[b]
        s0 = row_seq[r]
        s1 = row_seq[r + 1]
        t = row_tok[r]
        p = b * width
        row_total = 0
        for s in range(s0, s1):
            n = np.int64(seq_len[s])
            row_total += (n + m - 1) // m * m
        for s in range(s0, s1):
            n = np.int64(seq_len[s])
            w = (n + m - 1) // m * m
            if s == s1 - 1:
                w += width - row_total  # the row's tail folds into its last segment
            # each segment through views of its slots (indices from 0 compile to tighter loops than
            # offset ones); little-endian ids of 1, 2 or 4 bytes (the .npy files are "<u1/2/4"):
            # one compiled kernel for every token dtype
            ip = ids[p : p + w]
            tb = tokens[t * isz : (t + n) * isz]
            if isz == 1:
                for j in range(n):
                    ip[j] = np.int64(tb[j])
            elif isz == 2:
                for j in range(n):
                    ip[j] = np.int64(tb[2 * j]) | (np.int64(tb[2 * j + 1]) << 8)
            else:
                for j in range(n):
                    ip[j] = (
                        np.int64(tb[4 * j])
                        | (np.int64(tb[4 * j + 1]) << 8)
                        | (np.int64(tb[4 * j + 2]) << 16)
                        | (np.int64(tb[4 * j + 3]) << 24)
                    )
            lp = labels[p : p + w]
            pp = pos[p : p + w]
            mp = mask[t : t + n]
            for j in range(n - 1):  # the label of slot j is token j+1 where it is trained
                lp[j] = ip[j + 1] if mp[j + 1] else IGNORE
                pp[j] = j
            lp[n - 1] = IGNORE
            pp[n - 1] = n - 1
            for j in range(n, w):
                ip[j] = pad_id
                pp[j] = j
                lp[j] = IGNORE
            if w > max_seqlen:
                max_seqlen = w
            t += n
            p += w
            real_off += n
            c = seq_conv[s]
            conv[si] = c
            a = conv_offs[c]
            e = conv_offs[c + 1]
            simple = e - a >= 1 and conv_blob[a] == 34 and conv_blob[e - 1] == 34  # '"' ... '"'
            for k in range(a, e):
                v = conv_blob[k]
                id_buf[q] = v
                q += 1
                if v == 92:  # a backslash: an escaped string, left to the JSON parser
                    simple = False
            plain[si] = 1 if simple else 0
            si += 1
            cu[si] = real_off
            cup[si] = p
            id_bounds[si] = q
    return status, ids, labels, pos, cu, cup, max_seqlen, conv, id_buf, id_bounds, plain


def load() -> Any:
    """The numba dispatcher of :func:`collate_rows` (created once; compiles on its first call,
    or loads from numba's on-disk cache)."""
    global _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                import numba  # start-up: numba (~1 s) only for the compiled collate

                check = numba.njit(cache=True, nogil=True)(_check)
                globals()["_check"] = check  # the kernel resolves its helper as a module global when it compiles
                _compiled = numba.njit(cache=True, nogil=True)(_collate_rows)
    return _compiled


def collate_rows(*args: Any) -> tuple[int, Any, Any, Any, Any, Any, int, Any, Any, Any, Any]:
    """Lay global ``rows`` end to end (see the module docstring); arguments as :func:`_collate_rows`:
    ``tokens`` (the token file's bytes, ``uint8``), ``isz`` (bytes per id: 1, 2 or 4), ``mask``, the
    index ``(row_seq, row_tok, seq_len, seq_conv, conv_offs, conv_blob)`` as one tuple, ``rows, width,
    m, pad_id``.

    Returns ``(status, input_ids, labels, position_ids, cu_seqlens (int32), cu_seqlens_padded (int32),
    max_seqlen, conversation numbers, id bytes, id bounds, plain-string flags)``; on a nonzero status
    the arrays are empty.
    """
    return load()(*args)
