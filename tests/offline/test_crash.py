"""Crash safety: a prepack killed with SIGKILL mid-write, or hitting a full disk, leaves
nothing that opens; a rerun writes the same bytes; an --overwrite killed at any point of its
publish leaves the old prepack or the new one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftpack.offline import PrepackedDataset, PrepackError, prepack
from sftpack.offline._format import FILES
from sftpack.offline._publish import recover

from .conftest import MAX_SEQ_LEN

# The child runs a real prepack and is blocked at a chosen moment by what the test passes in:
# after the first chunk of rows is written, by an engine whose write stage blocks there; with
# every file and the manifest written, just before the publish; just before or just after the
# atomic exchange of --overwrite; between the two renames of the fallback for systems without
# renameat2 (these by a patched function of the publish step, in the child only). It then
# signals readiness, so the kill lands exactly there.
CHILD = r"""
import os, sys, time
from pathlib import Path
mode, inp, out, ready, width, overwrite = sys.argv[1:7]
import sftpack.offline._publish as pub
from sftpack.offline import prepack
from sftpack.offline.engine import LocalEngine, write_rows
from sftpack.testing import tiny_chat_tokenizer

def block(*args, **kwargs):
    Path(ready).write_text(mode)
    time.sleep(120)

class BlockAfterFirstChunk(LocalEngine):
    def write(self, directory, plan, staged, dtype):
        write_rows(directory, plan, staged.source, dtype, chunk_tokens=2048, on_chunk=block)

engine = BlockAfterFirstChunk() if mode == "write" else "local"
if mode == "publish":
    pub.Output.publish = block
elif mode in ("before-exchange", "exchanged"):
    rename2 = pub._renameat2
    def at_exchange(src, dst, flags):
        if flags == pub._RENAME_EXCHANGE and mode == "before-exchange":
            block()
        done = rename2(src, dst, flags)
        assert done, "this filesystem has no RENAME_EXCHANGE"
        if flags == pub._RENAME_EXCHANGE:
            block()
        return done
    pub._renameat2 = at_exchange
elif mode == "between-renames":
    pub._renameat2 = lambda src, dst, flags: False  # a system without renameat2: the two-rename fallback
    rename = os.rename
    def parked_then_block(src, dst):
        rename(src, dst)
        if ".sftpack-old-" in str(dst):
            block()
    os.rename = parked_then_block
prepack(inp, out, tokenizer=tiny_chat_tokenizer("chatml"), max_seq_len=int(width), pad_multiple=4,
        overlong="split", overwrite=overwrite == "1", engine=engine)
"""

FSIZE_CHILD = r"""
import resource, sys
from sftpack.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.sftpack-partial-*"))


def _hidden(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.sftpack-*"))


def _child(mode, chat_file, out, ready, width, *, overwrite):
    args = [mode, str(chat_file), str(out), str(ready), str(width), "1" if overwrite else "0"]
    return subprocess.Popen([sys.executable, "-c", CHILD, *args])


def _kill_at_hooks(procs):
    """Wait until every child has reached its hook, then SIGKILL it there."""
    try:
        for mode, (proc, _, ready) in procs.items():
            deadline = time.monotonic() + 150
            while not ready.exists():
                assert proc.poll() is None, f"the {mode} child exited early with {proc.returncode}"
                assert time.monotonic() < deadline, f"the {mode} child never reached its hook"
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL
    finally:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_kill_9_mid_write_and_before_the_rename_leaves_nothing_that_opens(built, chat_file, tok, tmp_path):
    procs = {}
    for mode in ("write", "publish"):
        out, ready = tmp_path / mode, tmp_path / f"{mode}.ready"
        procs[mode] = (_child(mode, chat_file, out, ready, MAX_SEQ_LEN, overwrite=False), out, ready)
    _kill_at_hooks(procs)
    for mode, (_, out, _) in procs.items():
        assert not out.exists(), "the output appears only by the final rename"
        partials = _partials(tmp_path, mode)
        assert len(partials) == 1
        assert (partials[0] / "manifest.json").exists() == (mode == "publish")
        with pytest.raises(PrepackError, match="did not finish"):
            PrepackedDataset(partials[0])
        with pytest.raises(PrepackError, match="no such directory"):
            PrepackedDataset(out)
    # a rerun removes the dead run's partial folder and writes the same bytes as a clean run
    out = procs["write"][1]
    prepack(chat_file, out, tokenizer=tok, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, overlong="split")
    assert _partials(tmp_path, "write") == []
    for f in sorted(built[1].iterdir()):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_full_disk_mid_write_is_a_clean_error_and_leaves_nothing(chat_file, tok, tmp_path):
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    out = tmp_path / "out"
    # a file-size limit makes the big write fail with EFBIG, as a full disk fails with ENOSPC
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FSIZE_CHILD,
            "50000",
            "prepack",
            str(chat_file),
            "--out",
            str(out),
            "--tokenizer",
            str(tok_dir),
            "--max-seq-len",
            "1024",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("sftpack prepack: writing the prepack") and "File too large" in err
    assert f"nothing was left at {out}" in err
    assert not out.exists() and _partials(tmp_path, "out") == []


def test_overwrite_killed_at_any_point_of_the_swap_leaves_the_old_prepack_or_the_new_one(
    built, chat_file, tok, tmp_path
):
    """The old prepack (1024 wide) is replaced by a new one (512 wide) with --overwrite; each
    child is killed at one point of the publish. Afterwards the output opens (verify="full") as
    the old or the new prepack, never neither; with the two-rename fallback (no renameat2) the
    next run repairs the one moment where it is missing, and opening it meanwhile says so."""
    old_bytes = {f.name: f.read_bytes() for f in built[1].iterdir()}
    procs = {}
    for mode in ("before-exchange", "exchanged", "between-renames"):
        out, ready = tmp_path / mode, tmp_path / f"{mode}.ready"
        shutil.copytree(built[1], out)
        procs[mode] = (_child(mode, chat_file, out, ready, 512, overwrite=True), out, ready)
    _kill_at_hooks(procs)

    def is_old(out):
        return {f.name: f.read_bytes() for f in out.iterdir()} == old_bytes

    before, after, between = (procs[m][1] for m in ("before-exchange", "exchanged", "between-renames"))
    assert is_old(before) and PrepackedDataset(before, verify="full").max_seq_len == MAX_SEQ_LEN
    new = PrepackedDataset(after, verify="full")  # swapped in one step: the new one is in place
    assert new.max_seq_len == 512 and len(new) > 0
    # the old one sits in the dead run's hidden folder, which the next run removes
    assert len(_partials(tmp_path, after.name)) == 1
    # the fallback's two renames: killed between them, the output is missing for a moment ...
    assert not between.exists()
    parked = sorted(tmp_path.glob(f".{between.name}.sftpack-old-*"))
    assert len(parked) == 1 and (parked[0] / "manifest.json").is_file()
    with pytest.raises(PrepackError, match=rf"interrupted --overwrite left the previous prepack at .*{parked[0].name}"):
        PrepackedDataset(between)
    # ... and the next run for it first finishes the swap (the new folder was complete)
    recover(between)
    assert PrepackedDataset(between, verify="full").max_seq_len == 512 and _hidden(tmp_path, between.name) == []
    # a rerun with --overwrite cleans up after the dead runs and writes the same bytes as a clean run
    for out in (before, after):
        prepack(chat_file, out, tokenizer=tok, max_seq_len=512, pad_multiple=4, overlong="split", overwrite=True)
        assert _hidden(tmp_path, out.name) == []
        for f in FILES + ("manifest.json",):
            assert (out / f).read_bytes() == (between / f).read_bytes(), f


def test_recover_puts_the_old_prepack_back_when_the_new_one_never_finished(built, tmp_path):
    out = tmp_path / "p"
    dead = _dead_pid()
    parked = tmp_path / f".p.sftpack-old-{dead}-0000"
    shutil.copytree(built[1], parked)
    unfinished = tmp_path / f".p.sftpack-partial-{dead}-0000"
    unfinished.mkdir()
    (unfinished / "tokens.npy").write_bytes(b"half")
    recover(out)
    assert PrepackedDataset(out, verify="full").manifest == PrepackedDataset(built[1]).manifest
    assert not parked.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
