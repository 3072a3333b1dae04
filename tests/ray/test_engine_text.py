"""The Ray engine on a real local Ray: byte-identical to the local engine with 1 and 2
workers (one of them killed mid-run), and a worker that cannot load the tokenizer leaves
nothing that opens as a prepack; conversations with images: tests/ray/test_engine.py
(a file of its own, so that the two slow files can run on two test workers).

Each Ray run costs 8-20 s here (actor start, tokenizer load, a worker for the write
tasks), so these are few and share one Ray (``ray_cluster``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sftpack.offline import PrepackedDataset, PrepackError, prepack, prepack_ray
from sftpack.offline._format import FILES, MANIFEST
from sftpack.offline.engine import RayEngine

from .conftest import BAD_ROWS, PER_FILE
from .conftest import FILES as N_FILES

OPTIONS = {"max_seq_len": 1024, "pad_multiple": 4, "overlong": "split", "on_bad_row": "skip", "seed": 3}


def _files(path):
    return {name: (path / name).read_bytes() for name in FILES}


def test_local_and_ray_1_and_2_workers_write_the_same_bytes(ray_cluster, chat_dir, tok_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    local = prepack(chat_dir, tmp_path / "local", tokenizer=tok, **OPTIONS)
    one = prepack_ray(chat_dir, tmp_path / "ray1", tokenizer=str(tok_dir), workers=1, **OPTIONS)
    # with 2 workers, the actor that stages unit 1 is killed (SIGKILL) right after: Ray Data
    # restarts it and reruns the unit, which rewrites the same staging files
    killed = str(tmp_path / "killed-once")

    def kill_once(key):  # runs in the actor, pickled by value (a local function)
        if key == 1 and not os.path.exists(killed):
            Path(killed).touch()
            os.kill(os.getpid(), signal.SIGKILL)

    engine = RayEngine(workers=2, write_tasks=3, after_unit=kill_once)
    two = prepack(chat_dir, tmp_path / "ray2", tokenizer=str(tok_dir), engine=engine, **OPTIONS)
    assert os.path.exists(killed)

    expected = _files(local.path)
    for result in (one, two):
        got = _files(result.path)
        assert [n for n in FILES if got[n] != expected[n]] == []
        # the manifest too: same counts, fingerprint (tokenizer, inputs, options) and checksums
        assert json.loads((result.path / MANIFEST).read_text()) == json.loads((local.path / MANIFEST).read_text())

    c = two.counts
    # every input row accounted for, across the units of three files read by different actors
    assert c["read"] == N_FILES * PER_FILE + len(BAD_ROWS)
    assert c["dropped"] == {reason: 1 for _, reason in BAD_ROWS}
    assert c["kept"] == N_FILES * PER_FILE
    assert c["overlong"]["split"] > 0 and c["sequences"] > c["kept"]
    # each unit (one per file) went through one actor; their token counts add up to the prepack's
    assert sum(a["units"] for a in two.actors) == N_FILES
    assert sum(a["tokens"] for a in two.actors) == c["tokens"]
    assert two.writers[0]["rows"][0] == 0 and two.writers[-1]["rows"][1] == c["rows"] and len(two.writers) == 3
    ds = PrepackedDataset(two.path, verify="full")
    assert len(ds) == c["rows"]
    ds[len(ds) - 1].validate()


def test_a_tokenizer_missing_on_the_workers_fails_clearly_and_leaves_nothing(ray_cluster, chat_dir, tmp_path):
    out = tmp_path / "never"
    missing = tmp_path / "not-on-this-node"
    with pytest.raises(RuntimeError, match="cannot load the tokenizer") as err:
        prepack_ray(chat_dir, out, tokenizer=str(missing), workers=1, **OPTIONS)
    assert str(missing) in str(err.value) and "every node" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a partial directory
    with pytest.raises(PrepackError, match="no such directory"):
        PrepackedDataset(out)
