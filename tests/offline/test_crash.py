"""Crash safety: a prepack killed with SIGKILL mid-write, or hitting a full disk, leaves
nothing that opens; a rerun writes the same bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftpack.offline import PrepackedDataset, PrepackError, prepack

from .conftest import MAX_SEQ_LEN

# The child runs a real prepack; a hook blocks it at a chosen moment (after the first
# chunk of rows is written, or with every file and the manifest written, just before the
# rename) and signals readiness, so the kill lands exactly there.
CHILD = r"""
import sys, time
from pathlib import Path
mode, inp, out, ready = sys.argv[1:5]
import sftpack.offline._prepack as pp
import sftpack.offline._write as w
from sftpack.testing import tiny_chat_tokenizer

def block(*args, **kwargs):
    Path(ready).write_text(mode)
    time.sleep(120)

if mode == "write":
    original = w._pwrite_all
    def first_then_block(*args, **kwargs):
        original(*args, **kwargs)
        block()
    w._pwrite_all = first_then_block
    w.CHUNK_TOKENS = 2048
elif mode == "publish":
    pp.publish = block
pp.prepack(inp, out, tokenizer=tiny_chat_tokenizer("chatml"), max_seq_len=MAX_SEQ_LEN, pad_multiple=4, overlong="split")
""".replace("MAX_SEQ_LEN", str(MAX_SEQ_LEN))

FSIZE_CHILD = r"""
import resource, sys
from sftpack.cli import main
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def _partials(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f".{name}.sftpack-partial-*"))


def test_kill_9_mid_write_and_before_the_rename_leaves_nothing_that_opens(built, chat_file, tok, tmp_path):
    procs = {}
    for mode in ("write", "publish"):
        out, ready = tmp_path / mode, tmp_path / f"{mode}.ready"
        procs[mode] = (subprocess.Popen([sys.executable, "-c", CHILD, mode, str(chat_file), str(out), str(ready)]),
                       out, ready)
    try:
        for mode, (proc, out, ready) in procs.items():
            deadline = time.monotonic() + 120
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
        [sys.executable, "-c", FSIZE_CHILD, "50000", "prepack", str(chat_file), "--out", str(out),
         "--tokenizer", str(tok_dir), "--max-seq-len", "1024", "--no-progress"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("sftpack prepack: writing the prepack") and "File too large" in err
    assert f"nothing was left at {out}" in err
    assert not out.exists() and _partials(tmp_path, "out") == []
