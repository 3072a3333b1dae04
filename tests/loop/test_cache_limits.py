"""The tokenized-data cache at its limits: a change to sftpack's code is a new
entry, a full or read-only cache disk (or a file where an entry should be) leaves
the run going without the cache, the cache is bounded (least recently used
entries evicted past ``--cache-max-size``), and one variable names its folder.

How the real conditions are made: a full disk is a tmpfs filled to the last byte
(needs root to mount; skipped otherwise) and, everywhere, a file-size limit
(``RLIMIT_FSIZE``: the kernel refuses the write with EFBIG); a read-only cache is
a read-only bind mount (root, whom a 0o555 folder does not stop) or a 0o555
folder (anyone else)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import sftpack
from sftpack import data
from sftpack.chat._cache_entry import DEFAULT_MAX_SIZE, CacheWarning, default_cache_dir, parse_size
from sftpack.chat._training_samples import start_training_samples
from sftpack.cli import main
from sftpack.loop import tokenized_samples
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import train_args


def _convs(n=30):
    return [
        [
            {"role": "user", "content": f"count {i} " * (i % 4 + 1)},
            {"role": "assistant", "content": "one two three " * (i % 9 + 1)},
        ]
        for i in range(n)
    ]


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.input_ids.tobytes() == y.input_ids.tobytes() and x.loss_mask.tobytes() == y.loss_mask.tobytes()


@contextlib.contextmanager
def _cache_warnings():
    """The messages of the :class:`CacheWarning` s raised inside (each one, none filtered away)."""
    said: list[str] = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", CacheWarning)
        yield said
    said.extend(str(w.message) for w in record if issubclass(w.category, CacheWarning))


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer("chatml")


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "tokenized").glob("*") if not p.name.startswith("."))


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tokenized").glob(".*")) if (root / "tokenized").is_dir() else []


def _size(entry: Path) -> int:
    return sum(f.stat().st_size for f in entry.iterdir())


def _mount(*args: str) -> bool:
    return os.geteuid() == 0 and subprocess.run(["mount", *args], capture_output=True).returncode == 0


# ---------------------------------------------------------------------------- the code is in the key


def test_a_change_to_the_masking_code_is_a_new_entry(tok, tmp_path):
    """The issue's case: after a change to the mask rule the cache served the old masks."""
    convs = _convs()
    first = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path / "cache").finish()
    assert first.entry is not None and not first.hit
    # the same sftpack with one mask rule changed (each assistant span loses its first token)
    copy = tmp_path / "src" / "sftpack"
    shutil.copytree(Path(sftpack.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    code = (copy / "chat" / "_tokenize.py").read_text()
    assert code.count("mask[t0:t] = True") == 1
    (copy / "chat" / "_tokenize.py").write_text(code.replace("mask[t0:t] = True", "mask[t0 + 1 : t] = True"))
    script = textwrap.dedent(
        f"""
        import json, sys, sftpack
        from sftpack.chat._training_samples import start_training_samples
        from sftpack.testing import tiny_chat_tokenizer
        assert sftpack.__file__.startswith({str(copy)!r}), sftpack.__file__
        got = start_training_samples(tiny_chat_tokenizer("chatml"), json.loads(sys.stdin.read()), max_seq_len=24,
                                     cache_dir={str(tmp_path / "cache")!r}).finish()
        print(json.dumps([got.hit, got.stats.trainable_tokens]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], input=json.dumps(convs), env=env, capture_output=True, text=True, check=True
    )
    hit, trainable = json.loads(out.stdout.strip().splitlines()[-1])
    assert not hit  # tokenized again by the changed code, not read from the entry of the old one
    assert trainable < first.stats.trainable_tokens
    assert len(_entries(tmp_path / "cache")) == 2
    again = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path / "cache").finish()
    assert again.hit and again.stats.trainable_tokens == first.stats.trainable_tokens  # the old code's entry


# ---------------------------------------------------------------------------- cannot write


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs with ``tokenized/`` made, then filled to the last byte."""
    where = tmp_path / "full"
    where.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)):
        pytest.skip("mounting a tmpfs needs root")
    try:
        (where / "tokenized").mkdir()
        with open(where / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 1024)
        assert os.statvfs(where).f_bavail == 0
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_cli_trains_without_the_cache_on_a_full_disk(chat, full_disk, tmp_path, capsys):
    more = ["--cache-dir", str(full_disk), "--log", str(tmp_path / "log.jsonl")]
    args = train_args(chat / "chat.jsonl", *more, tokenizer=chat / "tok")
    assert main(args) == 0
    said = capsys.readouterr()
    assert "not cached" in said.out and "cached in" not in said.out
    assert json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])["step"] == 1
    warned = [line.rsplit("\r", 1)[-1] for line in said.err.splitlines() if "warning" in line]
    assert warned == [  # the CLI says a library warning in one line (a bar's carriage returns aside)
        f"sftpack: warning: cannot write the tokenized-data cache in {full_disk}: [Errno 28] No space left on "
        "device; going on without the cache"
    ]
    assert _entries(full_disk) == [] and _leftovers(full_disk) == []  # no .tmp-* left behind


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Files of this process may not grow past ``limit`` bytes (the write fails with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)


def test_a_failed_write_warns_and_leaves_nothing(tok, tmp_path):
    convs = _convs()
    eager, _ = tokenized_samples(tok, convs, max_seq_len=24)
    with _cache_warnings() as said, _file_size_limit(512):
        got = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    _same(eager, got.samples)
    assert not got.hit and got.entry is None
    assert said == [
        f"cannot write the tokenized-data cache in {tmp_path}: [Errno 27] File too large; going on without the cache"
    ]
    assert _entries(tmp_path) == [] and _leftovers(tmp_path) == []
    again = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert not again.hit and again.entry is not None and _entries(tmp_path) == [again.entry]


@pytest.fixture
def read_only(tmp_path):
    """``make()`` turns ``tmp_path / "ro"`` read-only (as it is for this process)."""
    where = tmp_path / "ro"
    where.mkdir()
    mounted = []

    def make() -> str:
        if os.geteuid() != 0:
            for p in [where, *where.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
            return "[Errno 13] Permission denied"
        if not (_mount("--bind", str(where), str(where)) and _mount("-o", "remount,ro,bind", str(where))):
            pytest.skip("a read-only bind mount failed")
        mounted.append(where)
        return "[Errno 30] Read-only file system"

    yield where, make
    for p in mounted:
        subprocess.run(["umount", str(p)], check=True)
    for p in [where, *where.rglob("*")]:
        if p.is_dir():
            p.chmod(0o755)


def test_a_read_only_cache_is_read_and_not_written(tok, read_only):
    where, make = read_only
    convs = _convs()
    stored = start_training_samples(tok, convs, max_seq_len=24, cache_dir=where).finish()
    why = make()
    with _cache_warnings() as quiet:
        hit = start_training_samples(tok, convs, max_seq_len=24, cache_dir=where).finish()
    assert hit.hit and hit.entry == stored.entry and quiet == []  # its last use cannot be noted: fine
    with _cache_warnings() as said:
        other = start_training_samples(tok, convs, max_seq_len=32, cache_dir=where).finish()
    assert not other.hit and other.entry is None
    assert said == [f"cannot write the tokenized-data cache in {where}: {why}; going on without the cache"]
    _same(hit.samples, stored.samples)


def test_a_file_where_an_entry_folder_should_be_is_replaced(tok, tmp_path):
    convs = _convs()
    entry = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish().entry
    assert entry is not None
    shutil.rmtree(entry)
    entry.write_text("not an entry")
    with _cache_warnings() as said:
        got = start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish()
    assert said == [f"tokenized-data cache entry {entry} is damaged (a file, not a folder): rebuilding it"]
    assert not got.hit and got.entry == entry and entry.is_dir()  # "cached in ENTRY" is true
    assert start_training_samples(tok, convs, max_seq_len=24, cache_dir=tmp_path).finish().hit
    assert _leftovers(tmp_path) == []


def test_a_file_where_the_cache_folder_should_be_is_said(tok, tmp_path):
    (tmp_path / "tokenized").write_text("in the way")
    with _cache_warnings() as said:
        got = start_training_samples(tok, _convs(), max_seq_len=24, cache_dir=tmp_path).finish()
    assert got.entry is None  # the CLI says "not cached"
    assert said == [
        f"cannot write the tokenized-data cache in {tmp_path}: [Errno 17] File exists: "
        f"'{tmp_path / 'tokenized'}'; going on without the cache"
    ]


# ---------------------------------------------------------------------------- bounded


def test_least_recently_used_entries_go_past_the_limit(tok, tmp_path):
    convs = _convs()

    def run(n: int, limit: int = 0, where: Path = tmp_path):
        return start_training_samples(tok, convs, max_seq_len=n, cache_dir=where, cache_max_size=limit).finish()

    a, b, c = run(24).entry, run(28).entry, run(32).entry
    assert a and b and c
    now = time.time()
    for age, entry in ((300, b), (200, c), (100, a)):  # last used minutes ago: b first
        os.utime(entry, (now - age, now - age))
    assert run(24).hit and a.stat().st_mtime >= now - 1  # reading a marks it used: now b, then c, are the oldest
    d_size = _size(run(36, where=tmp_path / "elsewhere").entry)
    limit = _size(a) + _size(c) + d_size
    d = run(36, limit).entry
    assert d is not None and _entries(tmp_path) == sorted([a, c, d])  # b went, first
    assert sum(_size(e) for e in _entries(tmp_path)) <= limit
    # an entry larger than the limit is not written (nothing is evicted for it)
    with _cache_warnings() as warned:
        big = run(40, d_size // 2)
    assert big.entry is None and _entries(tmp_path) == sorted([a, c, d]) and _leftovers(tmp_path) == []
    [said] = warned
    assert said.startswith(f"not caching the tokenized data in {tmp_path}: its ") and said.endswith(
        f"exceed the cache's size limit of {d_size // 2:,} bytes"
    )
    # no limit: nothing evicted
    assert run(44).entry and len(_entries(tmp_path)) == 4


def test_sizes_and_the_flag(capsys):
    assert parse_size("0") == 0  # no limit
    assert parse_size("500M") == 500 * 2**20 and parse_size("10G") == 10 * 2**30 == DEFAULT_MAX_SIZE
    assert parse_size("1.5g") == 3 * 2**29 and parse_size("2KiB") == 2048 and parse_size("123") == 123
    for bad in ("", "ten", "-1G", "5X"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(SystemExit):
        main(["train", "--cache-max-size", "lots"])
    assert "--cache-max-size: 'lots' is not a size" in capsys.readouterr().err
    assert main(["train", "--no-cache", "--cache-max-size", "1G"]) == 2  # a limit of no cache: said, not ignored
    assert "give --cache-max-size or --no-cache, not both" in capsys.readouterr().err


# ---------------------------------------------------------------------------- one variable


def test_one_variable_names_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SFTPACK_CACHE", raising=False)
    monkeypatch.setenv("SFTPACK_CACHE_DIR", str(tmp_path / "one"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_cache_dir() == data.cache_dir() == tmp_path / "one"  # the tokenizer's build cache too
    monkeypatch.delenv("SFTPACK_CACHE_DIR")
    monkeypatch.setenv("SFTPACK_CACHE", str(tmp_path / "old"))
    with pytest.warns(FutureWarning, match="SFTPACK_CACHE is deprecated: set SFTPACK_CACHE_DIR"):
        assert default_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("SFTPACK_CACHE_DIR", str(tmp_path / "one"))
    with pytest.warns(FutureWarning, match=f"SFTPACK_CACHE={tmp_path / 'old'} is ignored"):
        assert data.cache_dir() == tmp_path / "one"
