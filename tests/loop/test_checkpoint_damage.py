"""Damaged checkpoints on resume (issue 16 item 8): every file of a checkpoint is
listed with its size and SHA-256 in ``checkpoint.json`` (written last, inside the
folder before it is renamed into place), so an emptied, overwritten, cut or
bit-flipped file is refused with one line naming it, before anything is
unpickled, and the refusal names the previous checkpoint to fall back to. Nothing
is lost: the log and every checkpoint stay as they were."""

from __future__ import annotations

import json
import os
import shutil
import zipfile

import pytest
import torch

from sftpack.cli import main
from sftpack.loop import CheckpointError, make_source, train
from sftpack.loop._checkpoint import latest_checkpoint, verify_checkpoint
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import max_param_diff, tiny_config, tiny_model, train_args

CFG = {"packing": "trainer", "steps": 6, "checkpoint_every": 2}


@pytest.fixture(scope="module")
def pristine(samples, tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4, and its log."""
    root = tmp_path_factory.mktemp("pristine")
    cfg = tiny_config(**CFG)
    train(
        cfg,
        source=make_source(cfg, samples=samples),
        model=tiny_model(),
        checkpoint_dir=root / "ckpt",
        log=root / "log.jsonl",
        stop_after=4,
    )
    return root


@pytest.fixture
def ckpt(pristine, tmp_path):
    shutil.copytree(pristine, tmp_path / "run")
    return tmp_path / "run"


def _resume(samples, run, **kw):
    cfg = tiny_config(**CFG)
    return train(
        cfg,
        source=make_source(cfg, samples=samples),
        model=tiny_model(seed=1),
        checkpoint_dir=run / "ckpt",
        log=run / "log.jsonl",
        resume=True,
        **kw,
    )


def _snapshot(run) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_checkpoint_json_lists_every_file(pristine):
    step = pristine / "ckpt" / "step_000004"
    manifest = json.loads((step / "checkpoint.json").read_text())
    assert sorted(manifest["files"]) == ["rank_0.pt", "state.pt"]
    assert manifest["step"] == 4
    assert sorted(p.name for p in step.iterdir()) == ["checkpoint.json", "rank_0.pt", "state.pt"]
    verify_checkpoint(step)  # a whole checkpoint verifies


def _empty(p):
    p.write_bytes(b"")


def _random(p):  # the same size: only the checksum can tell
    p.write_bytes(os.urandom(p.stat().st_size))


def _cut(p):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip_weight_bit(p):
    """One bit in the largest tensor's bytes (a weight or its AdamW moment): still a
    loadable file, so without the checksum the damage would be trained on silently."""
    with zipfile.ZipFile(p) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(p.read_bytes())
    # the local header: 30 bytes + name + extra field, then the stored (uncompressed) bytes
    name_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x04
    p.write_bytes(bytes(data))
    torch.load(p, map_location="cpu", weights_only=False)  # loads fine: the damage is silent


DAMAGE = {
    "empty state.pt": ("state.pt", _empty, "is 0 bytes"),
    "random state.pt": ("state.pt", _random, "does not match its SHA-256"),
    "half rank_0.pt": ("rank_0.pt", _cut, "bytes, checkpoint.json says"),
    "flipped bit in a weight": ("state.pt", _flip_weight_bit, "does not match its SHA-256"),
    "checkpoint.json removed": ("checkpoint.json", lambda p: p.unlink(), "is missing"),
    "checkpoint.json overwritten": ("checkpoint.json", lambda p: p.write_text('{"files": 3'), "cannot be read"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file(samples, ckpt, case):
    name, damage, says = DAMAGE[case]
    target = ckpt / "ckpt" / "step_000004" / name
    damage(target)
    before = _snapshot(ckpt)
    with pytest.raises(CheckpointError) as e:
        _resume(samples, ckpt)
    msg = str(e.value)
    assert msg.startswith(str(target)) and says in msg
    assert "write step_000002 into" in msg  # the fallback is named
    assert _snapshot(ckpt) == before  # nothing lost: the log and both checkpoints untouched


def test_falling_back_to_the_named_checkpoint_resumes_it(samples, ckpt):
    """The fix the refusal names works: pointing ``latest`` at step 2 resumes there,
    and the run then equals an uninterrupted one."""
    (ckpt / "ckpt" / "step_000004" / "state.pt").write_bytes(b"")
    (ckpt / "ckpt" / "latest").write_text("step_000002")
    out = _resume(samples, ckpt)
    assert out.resumed_from == 2 and [r.step for r in out.logs] == [3, 4, 5, 6]
    cfg = tiny_config(**CFG)
    full = train(cfg, source=make_source(cfg, samples=samples), model=tiny_model())
    assert out.losses == full.losses[2:]
    assert max_param_diff(out.model, full.model) == 0.0
    assert latest_checkpoint(ckpt / "ckpt").name == "step_000006"
    verify_checkpoint(ckpt / "ckpt" / "step_000006")


def test_a_damaged_latest_pointer_is_refused(samples, ckpt):
    (ckpt / "ckpt" / "latest").write_bytes(b"\x00\xffjunk")
    with pytest.raises(CheckpointError, match=r"latest holds .* not the name of a checkpoint folder"):
        _resume(samples, ckpt)


def test_cli_prints_one_line_naming_the_file(samples, tmp_path, capsys):
    """The same through ``sftpack train --resume``: exit 1, one line, the file named."""
    chat = tmp_path / "chat.jsonl"
    tiny_chat_tokenizer("chatml").save_pretrained(tmp_path / "tok")
    with chat.open("w") as f:
        for i in range(8):
            msgs = [
                {"role": "user", "content": "count " * (i + 1)},
                {"role": "assistant", "content": "one two " * (i + 1)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    base = train_args(chat, *ckpt, tokenizer=tmp_path / "tok", steps=2, batch_size=2, max_seq_len=128)
    assert main([*base, "--checkpoint-every", "2"]) == 0
    state = tmp_path / "ckpt" / "step_000002" / "state.pt"
    _empty(state)
    capsys.readouterr()
    assert main([*base, "--resume"]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"sftpack train: {state} is 0 bytes")
