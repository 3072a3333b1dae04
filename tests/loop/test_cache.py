"""The tokenized-data cache of ``sftpack train`` / ``tokenized_samples(cache=...)``:
a second run reads the same samples back, every input of the key changes it, a
damaged entry is rebuilt (never read), ``--no-cache`` writes nothing, and the
batches trained on are those of eager tokenization."""

from __future__ import annotations

import copy
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sftpack.chat._batch import TokenizeStats
from sftpack.chat._cache_entry import CacheWarning, EntryWriter, read_entry
from sftpack.chat._cache_key import cache_key, source_identity, tokenizer_identity
from sftpack.chat._training_samples import start_training_samples
from sftpack.cli import main
from sftpack.loop import TrainConfig, make_source, tokenized_samples
from sftpack.sample import Sample
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import train_args


def _convs(n=30, extra=""):
    return [
        [
            {"role": "user", "content": f"count {i} " * (i % 4 + 1) + extra},
            {"role": "assistant", "content": "one two three " * (i % 9 + 1)},
        ]
        for i in range(n)
    ]


def _same(a: list[Sample], b: list[Sample]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.input_ids.dtype == y.input_ids.dtype and x.loss_mask.dtype == y.loss_mask.dtype
        assert x.input_ids.tobytes() == y.input_ids.tobytes()
        assert x.loss_mask.tobytes() == y.loss_mask.tobytes()
        assert x.conversation_id == y.conversation_id and type(x.conversation_id) is type(y.conversation_id)
        assert x.meta == y.meta


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "tokenized").glob("*") if not p.name.startswith("."))


def test_second_call_reads_the_cache_and_gives_the_same_samples(tok, tmp_path):
    convs = _convs()
    # max_seq_len 24 splits the longer conversations: pieces and their meta go through the cache too
    eager, eager_stats = tokenized_samples(tok, convs, max_seq_len=24)
    assert any(s.meta.get("piece") for s in eager)
    first = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    second = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert not first.hit and second.hit and first.entry == second.entry
    assert _entries(tmp_path) == [first.entry]
    _same(eager, first.samples)
    _same(eager, second.samples)
    assert second.stats == eager_stats
    again, stats = tokenized_samples(tok, convs, max_seq_len=24, cache=tmp_path)
    _same(eager, again)


def test_every_part_of_the_key_changes_it(tok):
    convs = _convs()
    opts = {"max_seq_len": 24, "overlong": "split"}
    base = cache_key(tokenizer_identity(tok), opts, source_identity(convs))
    assert base == cache_key(tokenizer_identity(copy.deepcopy(tok)), dict(opts), source_identity(_convs()))
    other_template = copy.deepcopy(tok)
    other_template.chat_template = tok.chat_template.replace("\\n", " ")
    changed = {
        "option": cache_key(tokenizer_identity(tok), {**opts, "max_seq_len": 25}, source_identity(convs)),
        "template": cache_key(tokenizer_identity(other_template), opts, source_identity(convs)),
        "input": cache_key(tokenizer_identity(tok), opts, source_identity(_convs(extra="!"))),
        "limit": cache_key(tokenizer_identity(tok), opts, source_identity(convs, limit=5)),
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed)


def test_file_inputs_are_keyed_by_their_bytes(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"messages": []}\n')
    before = source_identity(paths=[f])
    assert source_identity(paths=[f]) == before
    f.write_text('{"messages": [] }\n')
    assert source_identity(paths=[f]) != before
    assert source_identity(paths=[tmp_path / "*.jsonl"]) is None  # a glob: not cached
    assert source_identity(iter(_convs())) is None  # a one-pass iterator: not cached


@pytest.mark.parametrize("damage", ["flip", "cut", "manifest"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tok, tmp_path, damage):
    convs = _convs()
    first = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert first.entry is not None
    if damage == "flip":
        path = first.entry / "tokens.u32"
        data = bytearray(path.read_bytes())
        data[5] ^= 1  # same size, other content: only the checksum can tell
        path.write_bytes(bytes(data))
    elif damage == "cut":
        path = first.entry / "mask.u8"
        path.write_bytes(path.read_bytes()[:-3])
    else:
        (first.entry / "manifest.json").write_text("{")
    with pytest.warns(CacheWarning, match=f"cache entry {re.escape(str(first.entry))} is damaged .*: rebuilding it"):
        again = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert not again.hit
    _same(first.samples, again.samples)
    third = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert third.hit  # the rebuilt entry is whole again
    _same(first.samples, third.samples)


def test_two_writers_of_one_entry_leave_one_whole_entry(tok, tmp_path):
    samples, stats = tokenized_samples(tok, _convs(), max_seq_len=24)
    entry = tmp_path / "tokenized" / "k"
    writers = [EntryWriter(entry, "k"), EntryWriter(entry, "k")]
    for w in writers:
        for s in samples:
            w.add(s)
    for w in writers:  # the second rename finds the entry there and drops its copy
        w.commit(stats)
    got = read_entry(entry, "k")
    assert got is not None
    _same(samples, got[0])
    assert [p.name for p in (tmp_path / "tokenized").iterdir()] == ["k"]


def test_folders_of_runs_killed_long_ago_are_swept(tok, tmp_path):
    root = tmp_path / "tokenized"
    old, fresh = root / ".tmp-old-run", root / ".tmp-running"
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "tokens.u32").write_bytes(b"1234")
    day_and_more = time.time() - 25 * 3600
    os.utime(old, (day_and_more, day_and_more))
    start_training_samples(tok, _convs(), max_seq_len=24, cache_dir=tmp_path).finish()
    assert not old.exists() and fresh.exists()  # a run writing now is left alone


def test_ids_that_do_not_survive_json_are_not_cached(tok, tmp_path):
    samples = [Sample(np.array([1, 2]), np.array([False, True]), conversation_id=("a", 1))]
    w = EntryWriter(tmp_path / "tokenized" / "k", "k")
    w.add(samples[0])
    with pytest.warns(CacheWarning, match="not caching the tokenized data: .*JSON"):
        w.commit(TokenizeStats())
    assert not (tmp_path / "tokenized" / "k").exists()
    assert list((tmp_path / "tokenized").iterdir()) == []


def test_cached_samples_give_the_eager_batches(tok, tmp_path):
    convs = _convs(40)
    eager, _ = tokenized_samples(tok, convs, max_seq_len=32)
    start_training_samples(tok, convs, max_seq_len=32, cache_dir=tmp_path).finish()
    cached = start_training_samples(tok, convs, max_seq_len=32, cache_dir=tmp_path).finish()
    assert cached.hit
    for packing in ("trainer", "loader", "none"):
        cfg = TrainConfig(packing=packing, steps=3, batch_size=4, max_seq_len=32)
        a, b = make_source(cfg, samples=eager), make_source(cfg, samples=cached.samples)
        assert a.fingerprint() == b.fingerprint()
        for _ in range(3):
            for x, y in zip(a.next_step(), b.next_step(), strict=True):
                for name in ("input_ids", "labels"):
                    assert torch.equal(getattr(x, name), getattr(y, name))


def _cli(chat, *extra):
    return train_args(chat / "chat.jsonl", *extra, tokenizer=chat / "tok")


def test_cli_reuses_the_cache_and_no_cache_writes_nothing(chat, tmp_path, capsys, monkeypatch):
    default = tmp_path / "default"
    monkeypatch.setenv("SFTPACK_CACHE_DIR", str(default))
    assert main(_cli(chat, "--no-cache", "--log", str(tmp_path / "a.jsonl"))) == 0
    assert "not cached" in capsys.readouterr().out and not default.exists()
    assert main(_cli(chat, "--log", str(tmp_path / "b.jsonl"))) == 0
    assert "cached in" in capsys.readouterr().out and len(_entries(default)) == 1
    assert main(_cli(chat, "--log", str(tmp_path / "c.jsonl"))) == 0
    assert "read from the cache" in capsys.readouterr().out
    own = tmp_path / "own"  # another folder, another option: a new entry there, none added to the default
    assert main(_cli(chat, "--cache-dir", str(own), "--max-seq-len", "48", "--log", str(tmp_path / "d.jsonl"))) == 0
    assert "cached in" in capsys.readouterr().out
    assert len(_entries(own)) == 1 and len(_entries(default)) == 1
    losses = [json.loads((tmp_path / f"{n}.jsonl").read_text())["loss"] for n in "abc"]
    assert len(set(losses)) == 1  # the same samples, the same first step, cached or not
