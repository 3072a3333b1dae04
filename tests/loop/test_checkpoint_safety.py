"""Checkpoints that keep one run's state, whatever happens around them (issue 26 item 6).

- A fresh ``sftpack train`` into a ``--checkpoint-dir`` holding another run's
  checkpoints is refused (one line: the folder, its latest step, the three ways
  forward); ``--overwrite-checkpoints`` replaces them.
- A save that fails (a full disk; here: a file-size limit, the same ``EFBIG`` /
  ``ENOSPC`` path in ``write()``) names the folder and the cause, leaves no
  ``step_N.tmp`` and keeps the previous checkpoint ``latest``.
- The model's dtype is part of what a resume is checked against (older
  checkpoints without it: the dtype of their saved weights).
- SIGTERM (a scheduler's preemption) stops ``sftpack train`` like Ctrl-C, exit 143,
  one line, no ``.tmp-*`` cache folder left; in the loop it first saves a
  checkpoint at the end of the current step, and the resumed run's losses equal
  the uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sftpack.cli import main
from sftpack.loop import CheckpointError, make_source, train
from sftpack.loop._checkpoint import latest_checkpoint
from tests.helpers import tiny_config, tiny_model, train_args

#: enough steps that SIGTERM, sent once the first step is logged, lands well before the last
STEPS = 200


def _args(chat, ckpt, log, cache, *extra, steps=STEPS):
    more = ["--vocab", "data", "--checkpoint-dir", str(ckpt), "--log", str(log), "--cache-dir", str(cache), *extra]
    return train_args(chat / "chat.jsonl", *more, tokenizer=chat / "tok", steps=steps, batch_size=2, dim=8)


def _losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _sftpack(args, **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "sftpack.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_for(what, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(chat, tmp_path_factory):
    """The uninterrupted run (checkpoints every 50 steps) and its cache folder."""
    root = tmp_path_factory.mktemp("reference")
    cache = root / "cache"
    assert main(_args(chat, root / "ckpt", root / "log.jsonl", cache, "--checkpoint-every", "50")) == 0
    return root


# ----------------------------------------------------------------------------- another run's folder


def test_a_fresh_run_into_another_runs_folder_is_refused(chat, reference, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(chat, ckpt, tmp_path / "log.jsonl", reference / "cache")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith(f"sftpack train: {ckpt} holds the checkpoints of another run (latest: step_000200)")
    assert "--resume" in line and "--overwrite-checkpoints" in line and "another --checkpoint-dir" in line
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before  # untouched
    # asked for: the new run's checkpoints replace the old run's, none of those is left
    short = _args(chat, ckpt, tmp_path / "log.jsonl", reference / "cache", "--checkpoint-every", "1", steps=2)
    assert main([*short, "--overwrite-checkpoints"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert latest_checkpoint(ckpt).name == "step_000002"


# ----------------------------------------------------------------------------- dtype


def test_resuming_in_another_dtype_is_refused_naming_both(chat, reference, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "ckpt", ckpt)
    capsys.readouterr()
    args = _args(chat, ckpt, tmp_path / "log.jsonl", reference / "cache", "--resume", "--dtype", "float64")
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"sftpack train: {ckpt / 'step_000200'}: the checkpoint's model is float32, ")
    assert "this run's float64" in err[0] and "--dtype float32" in err[0]


def _drop_dtype(step: Path) -> None:
    """The checkpoint as an sftpack without the dtype record wrote it (its checksums rewritten)."""
    state = torch.load(step / "state.pt", weights_only=False)
    del state["dtype"]
    torch.save(state, step / "state.pt")
    manifest = json.loads((step / "checkpoint.json").read_text())
    data = (step / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "checkpoint.json").write_text(json.dumps(manifest))


def test_an_older_checkpoint_is_checked_by_the_dtype_of_its_weights(samples, tmp_path):
    cfg = tiny_config(packing="trainer", steps=4, checkpoint_every=2)
    train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, stop_after=2)
    _drop_dtype(tmp_path / "step_000002")
    with pytest.raises(CheckpointError, match=r"the checkpoint's model is float32, this run's float64"):
        train(
            cfg,
            source=make_source(cfg, samples=samples),
            model=tiny_model(dtype=torch.float64),
            checkpoint_dir=tmp_path,
            resume=True,
        )
    out = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, resume=True)
    assert out.resumed_from == 2


# ----------------------------------------------------------------------------- a full disk


def test_a_failed_save_names_the_cause_and_keeps_the_previous_checkpoint(samples, tmp_path):
    """A real failing write: after step 3 no file may grow past 2 KB (``RLIMIT_FSIZE``;
    SIGXFSZ ignored, so ``write()`` fails with EFBIG as it fails with ENOSPC on a full disk)."""
    cfg = tiny_config(packing="trainer", steps=4, checkpoint_every=2)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def fill_the_disk(rec) -> None:
        if rec.step == 3:
            resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))

    try:
        with pytest.raises(CheckpointError) as err:
            train(
                cfg,
                source=make_source(cfg, samples=samples),
                model=tiny_model(),
                checkpoint_dir=tmp_path,
                on_step=fill_the_disk,
            )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    msg = str(err.value)
    assert msg.startswith(f"cannot write the checkpoint of step 4 into {tmp_path / 'step_000004.tmp'}: ")
    assert "[Errno 27] File too large" in msg and "step_000002" in msg
    assert "\n" not in msg and "inline_container" not in msg
    assert msg.endswith(
        "rerun with --resume to continue from step_000002, or give another --checkpoint-dir to start over"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002"]  # no step_000004.tmp
    assert latest_checkpoint(tmp_path).name == "step_000002"
    out = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model(), checkpoint_dir=tmp_path, resume=True)
    assert out.resumed_from == 2 and [r.step for r in out.logs] == [3, 4]


# ----------------------------------------------------------------------------- SIGTERM


def test_sigterm_in_the_loop_saves_and_the_resumed_run_continues_the_same_run(chat, reference, tmp_path, capsys):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    args = _args(chat, ckpt, log, reference / "cache", "--checkpoint-every", "50")
    proc = _sftpack(args)
    _wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    lines = err.strip().splitlines()
    m = re.fullmatch(
        r"sftpack train: stopped by SIGTERM after step (\d+); checkpoint saved in (.+); rerun with --resume to "
        r"continue",
        lines[-1],
    )
    assert m, lines[-1]
    step = int(m.group(1))
    assert 1 <= step < STEPS
    assert m.group(2) == str(ckpt / f"step_{step:06d}")
    assert latest_checkpoint(ckpt).name == f"step_{step:06d}"
    assert not list(ckpt.glob("*.tmp"))
    assert "Traceback" not in err
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    assert f"resumed from step {step}" in capsys.readouterr().out
    assert _losses(log) == _losses(reference / "log.jsonl")  # bit for bit: the uninterrupted run's


def test_sigterm_during_startup_cleans_up_like_ctrl_c(chat, tmp_path):
    """The signal arrives while the data is being tokenized into the cache: exit 143, one line,
    no checkpoint, and no temporary cache folder left behind."""
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        for i in range(5000):
            msgs = [{"role": "user", "content": f"count {i} " * 8}, {"role": "assistant", "content": "one two " * 8}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    cache, ckpt = tmp_path / "cache", tmp_path / "ckpt"
    args = _args(chat, ckpt, tmp_path / "log.jsonl", cache)
    args[1] = str(big)
    proc = _sftpack(args)
    _wait_for(lambda: any(".tmp-" in p.name for p in cache.rglob("*")) or proc.poll() is not None)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["sftpack train: stopped by SIGTERM before the first step; nothing was saved"]
    assert not [f for f in _files(cache) if ".tmp-" in f]
    assert not ckpt.exists() or not any(ckpt.iterdir())
