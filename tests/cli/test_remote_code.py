"""A model or tokenizer folder that asks for its own Python code (``auto_map``) never gets it run.

Without ``trust_remote_code=False``, transformers asks on standard input whether to run the
folder's code, so a ``y`` piped in (a wrapper, ``yes |``) ran it. Each folder here carries a
module that writes a marker file when imported: the commands and the library calls that load a
folder refuse it in one line (exit 2 on the command line), print no prompt, and the marker is
never written. A folder of a type transformers ships whose ``config.json`` also has an
``auto_map`` (as some hub folders do) still loads, with transformers' own classes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from sftpack._optional import CustomCodeError
from sftpack.cli import main
from sftpack.testing import tiny_chat_tokenizer

_MODULE = """\
open({marker!r}, "w").write("the folder's code ran")
from transformers import BaseImageProcessor, PretrainedConfig, PreTrainedTokenizerFast


class CustomConfig(PretrainedConfig):
    model_type = "sftpack_custom"


class CustomTokenizer(PreTrainedTokenizerFast):
    pass


class CustomImageProcessor(BaseImageProcessor):
    pass
"""


def _with_code(folder, marker) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "custom.py").write_text(_MODULE.format(marker=str(marker)))


def _set(path, **keys) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**data, **keys}))


def _custom_model(root):
    """A folder of a model type transformers does not ship, whose config and tokenizer name the
    folder's ``custom.py``; and the marker that module writes when it runs."""
    folder, marker = root / "custom_model", root / "RAN"
    tiny_chat_tokenizer("chatml").save_pretrained(folder)
    _with_code(folder, marker)
    _set(
        folder / "config.json",
        model_type="sftpack_custom",
        vocab_size=300,
        auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
    )
    _set(
        folder / "tokenizer_config.json",
        tokenizer_class="CustomTokenizer",
        auto_map={"AutoTokenizer": [None, "custom.CustomTokenizer"]},
    )
    return folder, marker


def _custom_tokenizer(root):
    """A tokenizer folder (no config.json) whose tokenizer class is the folder's own."""
    folder, marker = root / "custom_tokenizer", root / "RAN"
    tiny_chat_tokenizer("chatml").save_pretrained(folder)
    _with_code(folder, marker)
    _set(
        folder / "tokenizer_config.json",
        tokenizer_class="CustomTokenizer",
        auto_map={"AutoTokenizer": [None, "custom.CustomTokenizer"]},
    )
    return folder, marker


def _chats(root):
    path = root / "chats.jsonl"
    row = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def _refused(said: str, command: str, folder) -> None:
    assert said.startswith(f"sftpack {command}: {folder}{os.sep}") and said.count("\n") == 1, said[-2000:]
    assert "asks for the model folder's own Python code (auto_map)" in said
    assert "sftpack never runs a model folder's code (use a folder of a model type transformers ships)" in said
    assert "[y/N]" not in said and "trust_remote_code" not in said and "Traceback" not in said


def test_train_model_with_yes_piped_in_refuses_and_runs_nothing(tmp_path):
    """The case reproduced: the command as a process, ``y`` answers waiting on its standard input."""
    folder, marker = _custom_model(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "sftpack.cli", "train", str(_chats(tmp_path)), "--model", str(folder)],
        input="y\n" * 20,  # what `yes |` would answer to transformers' question
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    _refused(proc.stderr, "train", folder)
    assert not marker.exists()  # the folder's code never ran


@pytest.mark.parametrize(
    ("command", "flag", "make"),
    [
        ("verify", "--model", _custom_model),
        ("prepack", "--model", _custom_model),
        ("bench", "--model", _custom_model),
        ("prepack", "--tokenizer", _custom_tokenizer),
        ("train", "--tokenizer", _custom_tokenizer),
    ],
)
def test_every_command_refuses_it(tmp_path, monkeypatch, capsys, command, flag, make):
    folder, marker = make(tmp_path)
    stdin = io.StringIO("y\n" * 20)
    monkeypatch.setattr(sys, "stdin", stdin)
    out = ["--out", str(tmp_path / "rows")] if command == "prepack" else []
    assert main([command, str(_chats(tmp_path)), flag, str(folder), *out]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    _refused(said.err, command, folder)
    assert not marker.exists() and stdin.read() == "y\n" * 20  # nothing ran, nothing was asked
    assert not (tmp_path / "rows").exists()


def test_library_loads_refuse_it_without_reading_stdin(tmp_path, monkeypatch):
    from sftpack.loop import load_model
    from sftpack.multimodal import family_for

    model, marker = _custom_model(tmp_path)
    tokenizer, _ = _custom_tokenizer(tmp_path)
    images = tmp_path / "custom_images"  # caught by transformers itself (trust_remote_code=False)
    _with_code(images, marker)
    _set(
        images / "preprocessor_config.json",
        image_processor_type="CustomImageProcessor",
        auto_map={"AutoImageProcessor": "custom.CustomImageProcessor"},
    )
    stdin = io.StringIO("y\n" * 20)
    monkeypatch.setattr(sys, "stdin", stdin)
    qwen = family_for("qwen2_vl")
    for load, folder in [
        (load_model, model),
        (qwen.tokenizer, model),
        (qwen.tokenizer, tokenizer),
        (qwen.image_processor, images),
    ]:
        with pytest.raises(CustomCodeError, match=r"asks for the model folder's own Python code \(auto_map\)") as e:
            load(str(folder))
        assert str(folder) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists() and stdin.read() == "y\n" * 20  # nothing ran, nothing was asked


def test_a_shipped_model_type_with_an_auto_map_loads_with_transformers_classes(tmp_path, capsys):
    """Negative control: ``config.json`` names the folder's code, but its ``model_type`` is one
    transformers ships, which transformers uses under ``trust_remote_code=False``."""
    import transformers

    from sftpack.loop import load_model

    folder, marker = tmp_path / "llama", tmp_path / "RAN"
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tiny_chat_tokenizer("chatml").save_pretrained(folder)
    _with_code(folder, marker)
    _set(
        folder / "config.json",
        auto_map={"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"},
    )
    assert type(load_model(str(folder))).__name__ == "LlamaForCausalLM"
    out = tmp_path / "rows"
    assert main(["prepack", str(_chats(tmp_path)), "--model", str(folder), "--out", str(out), "--no-progress"]) == 0
    assert (out / "manifest.json").exists()
    assert not marker.exists()
