"""``sftpack train --save-model DIR`` never loses a training to its folder, nor merges into one
(issue 38 items 6 and 11d).

- The folder is checked before any work: a file in the way, a folder of other files, a parent
  that is a file: one line, exit 2, no step run.
- A folder with files in it is replaced only with ``--overwrite-model``, and then whole: none of
  its files stays beside the model.
- The folder is written beside ``DIR`` and renamed into place: a save that dies while writing
  the weights leaves the old folder as it was and no temporary behind.
- SIGTERM in a run without ``--checkpoint-dir`` saves the model of the last step (it said
  "nothing saved" before).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

from sftpack.cli import main
from sftpack.loop._export import save_model
from sftpack.loop._model_dir import check_model_dir
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import train_args
from tests.loop.test_checkpoint_safety import _sftpack, _wait_for


def _train(chat, out, log, *extra, steps=2):
    more = ["--log", str(log), "--save-model", str(out), *extra]
    return train_args(chat / "chat.jsonl", *more, tokenizer=chat / "tok", steps=steps, batch_size=2)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, args) -> str:
    capsys.readouterr()
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert "loss" not in captured.out and "wrote" not in captured.out  # no step ran, nothing written
    return err[0]


def test_a_file_in_the_way_is_refused_before_the_first_step(chat, tmp_path, capsys):
    (tmp_path / "model").write_text("my notes")
    log = tmp_path / "log.jsonl"
    line = _refused(capsys, _train(chat, tmp_path / "model", log))
    assert line == (
        f"sftpack train: --save-model {tmp_path / 'model'} is a file, not a folder: give a new folder's path "
        "(or an empty folder)"
    )
    assert not log.exists()  # not one step ran
    assert (tmp_path / "model").read_text() == "my notes"
    # a file where a parent folder would be made
    line = _refused(capsys, _train(chat, tmp_path / "model" / "sub", log))
    assert line.startswith(f"sftpack train: --save-model {tmp_path / 'model' / 'sub'}: {tmp_path / 'model'} is a file")
    assert not log.exists()
    # the flag does not make a file a folder
    line = _refused(capsys, [*_train(chat, tmp_path / "model", log), "--overwrite-model"])
    assert "is a file, not a folder" in line and not log.exists()


def test_a_folder_of_other_files_is_refused_untouched_and_replaced_whole_when_asked(chat, tmp_path, capsys):
    out, log = tmp_path / "out", tmp_path / "log.jsonl"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = _tree(out)
    line = _refused(capsys, _train(chat, out, log))
    assert line == (
        f"sftpack train: --save-model {out} is a folder with files in it (not a model folder): give a new folder's "
        "path (or an empty folder), or pass --overwrite-model (overwrite=True) to replace it whole"
    )
    assert _tree(out) == before and not log.exists()

    assert main([*_train(chat, out, log), "--overwrite-model"]) == 0
    assert f"wrote {out} (a Hugging Face model folder)" in capsys.readouterr().out
    files = sorted(p.name for p in out.iterdir())
    assert "notes.txt" not in files and "sub" not in files  # replaced whole: nothing of the old folder stays
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    AutoModelForCausalLM.from_pretrained(out)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or old folder left

    # a model folder saved before is replaced only when asked, too (the line says what it is)
    line = _refused(capsys, _train(chat, out, tmp_path / "log2.jsonl"))
    assert "is a folder with files in it (a model folder)" in line
    # an empty folder is taken as it is
    (tmp_path / "empty").mkdir()
    assert main(_train(chat, tmp_path / "empty", tmp_path / "log3.jsonl")) == 0
    assert (tmp_path / "empty" / "config.json").is_file()


def test_overwrite_model_needs_save_model(chat, tmp_path, capsys):
    args = _train(chat, tmp_path / "m", tmp_path / "log.jsonl", "--overwrite-model")
    i = args.index("--save-model")
    del args[i : i + 2]
    line = _refused(capsys, args)
    assert line == "sftpack train: --overwrite-model replaces the folder of --save-model DIR: give --save-model"


def test_the_library_checks_the_same(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_model_dir(tmp_path / "f")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(ValueError, match=r"folder with files in it .*overwrite=True"):
        check_model_dir(tmp_path / "d")
    check_model_dir(tmp_path / "d", overwrite=True)
    check_model_dir(tmp_path / "new" / "deeper")  # made at the save


def _tiny():
    tok = tiny_chat_tokenizer("chatml")
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg), tok


def test_a_save_that_dies_writing_the_weights_leaves_the_old_folder(tmp_path, monkeypatch):
    """A kill while the weights are written (here: their write raises, after config.json is
    written): the model folder saved before is there as it was, and no temporary is left."""
    model, tok = _tiny()
    out = tmp_path / "model"
    save_model(model, out, tokenizer=tok)
    before = _tree(out)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # another model: its config.json and weights would differ from the saved ones
    model.config.rms_norm_eps = 1e-3

    def killed(*a, **k):
        raise KeyboardInterrupt("killed while writing the weights")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        save_model(model, out, tokenizer=tok, overwrite=True)
    assert _tree(out) == before  # the old folder, whole: not a new config.json over old weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the temporary is gone
    monkeypatch.undo()
    # negative control: the same save, not killed, replaces the folder
    save_model(model, out, tokenizer=tok, overwrite=True)
    assert _tree(out) != before
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-3
    loaded = AutoModelForCausalLM.from_pretrained(out)
    mine = model.state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template


def test_sigterm_without_checkpoint_dir_saves_the_model(chat, tmp_path):
    """SIGTERM once a step is logged, no --checkpoint-dir: the run stops at the end of its step
    and writes --save-model (what it had trained), exit 143, one line saying so."""
    out, log = tmp_path / "model", tmp_path / "log.jsonl"
    args = _train(chat, out, log, "--cache-dir", str(tmp_path / "cache"), steps=200)
    proc = _sftpack(args)
    _wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 1)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    steps = len(log.read_text().splitlines())
    assert 1 <= steps < 200
    assert last == (
        f"sftpack train: stopped by SIGTERM after step {steps}; the model of step {steps} saved in {out} "
        "(no --checkpoint-dir: the run cannot be resumed)"
    )
    assert f"wrote {out} (a Hugging Face model folder)" in stdout
    assert "Traceback" not in err
    AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(chat / "tok").chat_template


def test_replacing_without_renameat2_swaps_by_two_renames(tmp_path, monkeypatch):
    """Where renameat2 cannot swap (not Linux, or a filesystem without it), the old folder is parked
    beside the new one and removed once the new one is in place: the same result, nothing left."""
    import sftpack._publish

    monkeypatch.setattr(sftpack._publish, "renameat2", lambda src, dst, flags: False)
    model, tok = _tiny()
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    save_model(model, out, tokenizer=tok, overwrite=True)
    assert not (out / "notes.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
