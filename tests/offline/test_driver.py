"""The driver and the engine interface on their own: any engine that stages and writes
through the interface gets the same bytes (here one that writes the rows backwards, in
small ranges); the driver refuses a manifest whose accounting does not add up; and an
explicit pad id is used as given, 0 included."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.offline import prepack, prepack_samples
from sftpack.offline._driver import build_manifest
from sftpack.offline._fingerprint import pad_id_of
from sftpack.offline._format import FILES
from sftpack.offline._write import row_chunks
from sftpack.offline.engine import LocalEngine, PrepackEngine, plan_rows, stage_samples, write_rows
from sftpack.testing import samples_from_lengths

from .conftest import MAX_SEQ_LEN


class Backwards(PrepackEngine):
    """Stage 1 by the local engine; stage 3 written last row first, a few rows at a time."""

    def __init__(self):
        self.local = LocalEngine()
        self.ranges = 0

    def stage(self, work, staging):
        return self.local.stage(work, staging)

    def write(self, directory, plan, staged, dtype):
        for rows in reversed(row_chunks(plan, chunk_tokens=3000)):
            write_rows(directory, plan, staged.source, dtype, rows=rows)
            self.ranges += 1


def test_an_engine_of_ones_own_writes_the_same_bytes(built, chat_file, tok, tmp_path):
    engine = Backwards()
    r = prepack(chat_file, tmp_path / "b", tokenizer=tok, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, engine=engine)
    assert engine.ranges > 3  # really written in pieces, last first
    for name in (*FILES, "manifest.json"):
        assert (r.path / name).read_bytes() == (built[1] / name).read_bytes(), name


def test_a_manifest_whose_accounting_does_not_add_up_is_refused(tmp_path):
    staged = stage_samples(samples_from_lengths([5, 10, 3]), tmp_path / "s")
    plan = plan_rows(staged.lengths, max_seq_len=16)
    ok = {"read": 3, "kept": 3, "dropped": {}}
    kw = {"source": "samples", "pad_id": 0, "dtype": np.dtype(np.uint16), "vocab": 20000, "files": {}}
    assert build_manifest(staged, plan, ok, {}, **kw)["counts"]["rows"] == plan.num_rows
    with pytest.raises(RuntimeError, match=r"accounting broke: read == kept \+ sum\(dropped\) \(4 != 3\)"):
        build_manifest(staged, plan, {"read": 4, "kept": 3, "dropped": {}}, {}, **kw)


def test_an_explicit_pad_id_is_used_as_given_even_zero(tok, tmp_path):
    assert pad_id_of(tok) != 0
    samples = samples_from_lengths([3, 4])
    for given, want in ((0, 0), (None, pad_id_of(tok)), (5, 5)):
        r = prepack_samples(
            samples, tmp_path / f"p{given}", max_seq_len=8, tokenizer=tok, pad_id=given, vocab_size=8000
        )
        assert r.manifest["pad_id"] == r.manifest["fingerprint"]["pad_id"] == want
