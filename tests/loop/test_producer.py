"""``start_training_samples(..., in_child=True)``: one forked producer process loads
the tokenizer, reads and orders the conversations and tokenizes them, streaming the
tokenizer's info, the order and the samples back. The samples, the sink, the
training batches and the cache entry's files are those of the in-process path; its
errors are raised in the parent with their type and message; a killed producer
gives an error naming how it ended; no process of it is left after an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sftpack.chat import BadRowError
from sftpack.chat._cache_key import tokenizer_info
from sftpack.chat._training_samples import Pending, start_training_samples
from sftpack.loop import TrainConfig, make_source
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import counting_conversations, train_args

#: a liveness guard for waits on another process (never a measured time)
GUARD_S = 120


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


def _job(tok, convs, cache_dir, **kw):
    kw.setdefault("ready", not kw.get("in_child"))
    return start_training_samples(tok, convs, max_seq_len=24, cache_dir=cache_dir, seed=3, **kw)


def _group(pgid: int, *, tracker: bool = True) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``; ``tracker=False`` leaves out
    Python's multiprocessing resource tracker, which the group has or not depending on whether
    this test process started one before (an earlier test of the same worker: Ray, a pool)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmdline = (d / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            if tracker or b"multiprocessing.resource_tracker" not in cmdline:
                out.append(int(d.name))
    return out


def _wait_until(cond, what):
    end = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < end, f"still not {what} after {GUARD_S} s"
        time.sleep(0.05)


def _steps(sink, packing, n=6):
    cfg = TrainConfig(packing=packing, steps=n, batch_size=4, max_seq_len=24, seed=3)
    src = make_source(cfg, samples=sink)
    return [src.next_step() for _ in range(n)]


@pytest.mark.parametrize("num_proc", [1, 2])
def test_the_producer_gives_the_in_process_samples_entry_and_batches(tok, tmp_path, num_proc):
    convs = counting_conversations(150)  # 3 tokenizer batches of 64: 3 sample messages
    here = _job(tok, convs, tmp_path / "here")
    tokenizing = Pending(here.finish)
    here_steps = _steps(here.sink, "trainer")
    want = tokenizing.result()
    child = _job(tok, convs, tmp_path / "child", in_child=True, num_proc=num_proc)
    assert child.done is None and child.pid is not None and child.pid != os.getpid()
    pending = Pending(child.finish)  # collected in the background while the steps read the sink
    child_steps = _steps(child.sink, "trainer")
    got = pending.result()
    assert not got.hit and got.entry is not None and want.entry is not None
    assert got.entry.name == want.entry.name  # the same key
    names = sorted(p.name for p in want.entry.iterdir())
    assert names == sorted(p.name for p in got.entry.iterdir()) and len(names) == 5
    for name in names:
        assert (got.entry / name).read_bytes() == (want.entry / name).read_bytes(), name
    assert len(got.samples) == len(want.samples) and any(s.meta.get("piece") for s in want.samples)
    for a, b in zip(want.samples, got.samples, strict=True):
        assert a.input_ids.dtype == b.input_ids.dtype and a.loss_mask.dtype == b.loss_mask.dtype
        assert a.input_ids.tobytes() == b.input_ids.tobytes() and a.loss_mask.tobytes() == b.loss_mask.tobytes()
        assert a.conversation_id == b.conversation_id and a.meta == b.meta
    assert got.stats == want.stats and got.tokenizer == want.tokenizer == tokenizer_info(tok)
    assert got.positions is not None and want.positions is not None
    assert got.positions.tolist() == want.positions.tolist() and got.conversations == want.conversations == 150
    for x, y in zip(here_steps, child_steps, strict=True):
        for mx, my in zip(x, y, strict=True):
            assert mx.sequence_ids == my.sequence_ids
            for name in ("input_ids", "labels"):
                assert torch.equal(getattr(mx, name), getattr(my, name))
    assert _group(child.pid) == []  # the producer and its workers have ended


def test_the_tokenizer_is_loaded_in_the_producer_only(tok, tmp_path):
    files = tmp_path / "tok"
    tok.save_pretrained(files)
    where = tmp_path / "loaded-in"

    def load():
        with open(where, "a") as f:
            f.write(f"{os.getpid()}\n")
        return tok

    job = _job(
        None, counting_conversations(12), tmp_path, tokenizer_files=files, load_tokenizer=("test", load), in_child=True
    )
    info = job.info()
    assert info == tokenizer_info(tok)
    assert where.read_text().split() == [str(job.pid)]  # once, in the producer
    got = job.finish()
    assert got.tokenizer == info and where.read_text().split() == [str(job.pid)]

    def refuse():
        raise AssertionError("the tokenizer was loaded on a cache hit")

    hit = _job(
        None,
        counting_conversations(12),
        tmp_path,
        tokenizer_files=files,
        load_tokenizer=("test", refuse),
        in_child=True,
    )
    assert hit.done is not None and hit.done.hit and hit.pid is None and hit.info() == info


def _bad_convs():
    convs = counting_conversations(100)
    convs[70] = [{"role": "user", "content": "a question and no answer"}]  # no trainable token
    return convs


@pytest.mark.parametrize("num_proc", [1, 2])
def test_an_error_in_the_producer_is_raised_with_its_type_and_message(tok, tmp_path, num_proc):
    with pytest.raises(BadRowError) as here:
        _job(tok, _bad_convs(), tmp_path / "here").finish()
    assert str(here.value).startswith("conversation 70: ")  # named: the id is its position
    job = _job(tok, _bad_convs(), tmp_path / "child", in_child=True, num_proc=num_proc)
    sink = job.sink
    assert sink is not None
    with pytest.raises(BadRowError) as there:
        job.finish()
    assert type(there.value) is type(here.value) and str(there.value) == str(here.value)
    assert there.value.reason == here.value.reason and there.value.source == here.value.source
    with pytest.raises(BadRowError):  # a step waiting for the conversation gets it too
        sink.group(70)
    assert _group(job.pid) == []
    assert not list((tmp_path / "child" / "tokenized").glob("*"))  # nothing cached, no temporary folder left


def test_errors_before_the_order_and_unpicklable_errors(tok, tmp_path):
    files = tmp_path / "tok"
    tok.save_pretrained(files)

    def broken():
        raise OSError(2, "No such file or directory", "tokenizer.json")

    job = _job(
        None, counting_conversations(5), tmp_path, tokenizer_files=files, load_tokenizer=("test", broken), in_child=True
    )
    with pytest.raises(FileNotFoundError, match=r"\[Errno 2\] No such file or directory: 'tokenizer.json'"):
        job.info()
    with pytest.raises(FileNotFoundError):  # the same error again, for every caller
        job.finish()

    class Local(Exception):  # defined here: not importable, so not picklable by reference
        pass

    def odd():
        raise Local("odd tokenizer")

    job = _job(
        None, counting_conversations(5), tmp_path, tokenizer_files=files, load_tokenizer=("test", odd), in_child=True
    )
    with pytest.raises(RuntimeError, match="^Local: odd tokenizer$"):
        job.sink  # noqa: B018 (waits for the order)
    assert _group(job.pid) == []


def test_a_killed_producer_gives_a_clear_error_and_leaves_no_process(tok, tmp_path):
    # 2,000 conversations: far more samples than a pipe holds, so the producer cannot end
    # before this test reads them, which it does only after killing it
    job = _job(tok, counting_conversations(2000), tmp_path, in_child=True, num_proc=2)
    assert job.sink is not None  # the order has come
    pid = job.pid
    _wait_until(lambda: len(_group(pid, tracker=False)) == 3, "the producer and its 2 workers")
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"tokenizer process \(pid {pid}\) ended with signal SIGKILL"):
        job.finish()
    _wait_until(lambda: _group(pid) == [], "rid of its workers")
    assert not list((tmp_path / "tokenized").glob("*"))  # no entry, no temporary folder


# sftpack train in a fresh process, counting the producers started and the tokenizer loads
# asked for in this (the parent) process; a producer's loads happen in its own memory
DRIVER = """
import sys
from sftpack.chat import _producer
from sftpack.cli import main
from sftpack.loop import _run_data

loads, producers = [], []
get, init = _run_data.Tokenizer.get, _producer._Producer.__init__

def counted_get(self):
    loads.append(1)
    return get(self)

def counted_init(self, prepare):
    init(self, prepare)
    producers.append(self.pid)

_run_data.Tokenizer.get, _producer._Producer.__init__ = counted_get, counted_init
rc = main(sys.argv[1:])
print("RESULT", rc, "producers", len(producers), "loads", len(loads), "pids", *producers)
"""


def test_sftpack_train_tokenizes_in_the_producer_on_a_miss(tok, tmp_path):
    files = tmp_path / "tok"
    tok.save_pretrained(files)
    chat = tmp_path / "chat.jsonl"

    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in counting_conversations(40)))
    more = ["--cache-dir", str(tmp_path / "cache"), "--num-proc", "2", "--device", "cpu"]
    args = train_args(chat, *more, tokenizer=files)
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT 0 producers 1 loads 0" in out.stdout, out.stdout  # the tokenizer loaded in the producer only
    again = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "RESULT 0 producers 0 loads 0" in again.stdout, again.stdout  # a hit: nothing forked, nothing loaded
    assert "read from the cache" in again.stdout


def test_sftpack_train_reports_a_bad_row_found_in_the_producer_and_leaves_nothing(tmp_path):
    chat = tmp_path / "chat.jsonl"
    convs = _bad_convs()
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    cache = tmp_path / "cache"
    args = ["train", str(chat), "--steps", "1", "--max-seq-len", "64", "--cache-dir", str(cache), "--num-proc", "2",
            "--device", "cpu", "--on-bad-row", "error"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]  # the driver ran; the command's own code is in RESULT
    result = out.stdout.split("RESULT ")[1].split()
    assert result[:5] == ["1", "producers", "1", "loads", "0"], out.stdout
    # the reader names the row: line 71 of the file (conversation 70)
    assert f"{chat}, line 71: none of the 1 messages is from the assistant" in out.stderr, out.stderr[-3000:]
    assert _group(int(result[6])) == []
    assert not list((cache / "tokenized").glob("*"))  # no entry, no temporary folder
