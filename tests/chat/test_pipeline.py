"""The whole path on damaged files: read -> tokenize -> pack -> rows, with every label accounted for.

Hypothesis writes a small corpus (JSON Lines, gzip, Parquet) of self-describing
conversations, damages the files at random (truncation, flipped bytes, inserted
garbage, deleted spans), and runs the pipeline in skip mode. Nothing may escape,
and the counts must close end to end: every conversation the reader kept is
tokenized or counted as skipped, and its supervised labels are either in the rows
(``PackedBatch.num_label_tokens``) or in ``stats.labels_lost``.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftpack.binpack import pack
from sftpack.chat import read_conversations, tokenize_conversation, tokenize_conversations
from sftpack.handoff import build_row
from tests.helpers import A, S, U, tok_of


def _rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        msgs = [S(f"sys {i}")] if i % 4 == 0 else []
        for t in range(1 + int(rng.integers(0, 3))):
            msgs += [U(f"q{i}.{t} " + "w" * int(rng.integers(0, 30))), A(f"a{i}.{t} " + "v" * int(rng.integers(0, 40)))]
        if i % 5 == 0:
            msgs[-1] = A(msgs[-1]["content"] + " <|im_end|> typed")  # special-token text, kept as text
        out.append({"messages": msgs})
    return out


def _files(rows: list[dict[str, Any]]) -> dict[str, bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    third = len(rows) // 3
    lines = [json.dumps(r).encode() + b"\n" for r in rows]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows[2 * third :]), buf, row_group_size=4)
    return {
        "a.jsonl": b"".join(lines[:third]),
        "b.jsonl.gz": gzip.compress(b"".join(lines[third : 2 * third]), mtime=0),
        "c.parquet": buf.getvalue(),
    }


DAMAGE = st.lists(
    st.tuples(
        st.sampled_from(["a.jsonl", "b.jsonl.gz", "c.parquet"]),
        st.sampled_from(["truncate", "flip", "insert", "delete"]),
        st.floats(0, 1),
        st.binary(min_size=1, max_size=12),
    ),
    max_size=4,
)


def _damage(data: bytes, op: str, where: float, junk: bytes) -> bytes:
    k = int(where * len(data))
    if op == "truncate":
        return data[:k]
    if op == "flip" and data:
        k = min(k, len(data) - 1)
        return data[:k] + bytes([data[k] ^ (junk[0] | 1)]) + data[k + 1 :]
    if op == "insert":
        return data[:k] + junk + data[k:]
    return data[:k] + data[k + len(junk) :]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(3, 30),
    st.integers(0, 2**16),
    DAMAGE,
    st.sampled_from(["split", "truncate", "drop"]),
    st.integers(8, 120),
    st.sampled_from([1, 4]),
)
def test_damaged_corpus_end_to_end_accounting(
    tmp_path_factory: Any, n: int, seed: int, damage: list[Any], overlong: str, max_seq_len: int, pad_multiple: int
) -> None:
    folder: Path = tmp_path_factory.mktemp("corpus")
    files = _files(_rows(n, seed))
    for name, op, where, junk in damage:
        files[name] = _damage(files[name], op, where, junk)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    tok = tok_of("chatml")
    capacity = max_seq_len // pad_multiple * pad_multiple or pad_multiple

    reader = read_conversations(folder, on_bad_row="skip")
    kept = list(reader)
    r = reader.stats
    assert r.read == r.kept + sum(r.dropped.values()) and r.kept == len(kept)
    assert r.files_read + sum(r.files_skipped.values()) == 3

    out = tokenize_conversations(kept, tok, max_seq_len=capacity, overlong=overlong, on_bad_row="skip")
    samples = out.to_list()
    t = out.stats
    assert t.conversations == len(kept) and t.skipped == {}  # the reader's checks are the tokenizer's
    assert t.conversations == t.fit + t.truncated + t.dropped + t.split

    # pack and build the rows as the offline path does (sequences padded to pad_multiple)
    lengths = np.array([len(s) for s in samples], dtype=np.int64)
    in_rows = 0
    if len(samples):
        for bin_ in pack(lengths, capacity, cost_multiple=pad_multiple):
            members = [samples[i] for i in bin_]
            row = build_row(
                np.concatenate([s.input_ids for s in members]),
                np.concatenate([s.loss_mask for s in members]),
                [len(s) for s in members],
                max_seq_len=capacity,
                pad_multiple=pad_multiple,
                sequence_ids=[s.conversation_id for s in members],
            )
            in_rows += row.num_label_tokens
    assert in_rows == t.label_tokens

    # every kept conversation's supervised labels, counted alone and whole
    whole = sum(int(tokenize_conversation(c, tok).loss_mask[1:].sum()) for c in kept)
    assert whole == t.labels == in_rows + t.labels_lost
    if overlong == "split":
        assert t.labels_lost == t.split_labels_lost
