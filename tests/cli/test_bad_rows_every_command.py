"""One rule for a conversation the tokenizer cannot use, on every command (issue 38, item 3): a chat
template that raises on one row, a row whose rendering holds no trainable token, a tool call the
template does not write. With ``--on-bad-row skip`` (the default) each is counted under its reason
and the rest is packed / trained / measured, exit 0; with ``--on-bad-row error`` the command stops
at the first in one line naming the file and its line, exit 1."""

from __future__ import annotations

import json
import re

import pytest

from sftpack.cli import main

#: a template that refuses roles out of turn, leaves out an assistant turn saying HIDDEN, and writes
#: no tools (nor tool calls)
STRICT = (
    "{% for m in messages %}"
    "{% if m.role != 'tool' and (m.role == 'user') != loop.index0 is even %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m.content != 'HIDDEN' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}


def _good(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}


ROWS = [
    _good(0),
    _good(1),
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "HIDDEN"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                  {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]},
    _good(5),
]  # fmt: skip
#: what each bad row is counted under (lines 3 and 5: template_error; line 4: no_trainable_tokens)
SKIPPED = {"template_error": 2, "no_trainable_tokens": 1}
GOOD = 3


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    template = tmp_path / "strict.jinja"
    template.write_text(STRICT)
    return path, ["--chat-template", str(template), "--max-seq-len", "64"]


def test_prepack_counts_each_bad_row_under_its_reason_and_packs_the_rest(data, tmp_path, capsys):
    path, flags = data
    out = tmp_path / "pp"
    assert main(["prepack", str(path), "--out", str(out), *flags, "--no-progress"]) == 0
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["dropped"] == SKIPPED and counts["read"] == len(ROWS) and counts["kept"] == GOOD
    assert counts["packed_conversations"] == GOOD == counts["sequences"]
    said = capsys.readouterr().out
    assert re.search(r"dropped \(by reason\)\s+no_trainable_tokens 1, template_error 2", said), said


def test_train_one_step_counts_the_bad_rows_and_trains_on_the_rest(data, capsys):
    path, flags = data
    argv = ["train", str(path), *flags, "--steps", "1", "--batch-size", "2", "--no-cache"]
    assert main([*argv, "--dim", "16", "--layers", "1", "--heads", "2"]) == 0
    said = capsys.readouterr().out
    assert f"data: {len(ROWS)} conversations -> {GOOD} samples" in said, said
    assert "3 skipped (no_trainable_tokens 1, template_error 2;" in said, said


def test_bench_counts_the_same_rows(data, capsys):
    path, flags = data
    assert main(["bench", str(path), *flags]) == 0
    said = capsys.readouterr().out
    assert f"{len(ROWS)} conversations -> {GOOD} samples" in said and "3 skipped" in said, said
    assert "skipped: no_trainable_tokens 1, template_error 2" in said, said


@pytest.mark.parametrize(
    "command",
    [
        ["prepack", "--no-progress"],
        ["bench"],
        ["train", "--steps", "1", "--batch-size", "2", "--no-cache", "--dim", "16", "--layers", "1", "--heads", "2"],
    ],
)
def test_on_bad_row_error_stops_in_one_line_naming_the_file_and_line(data, tmp_path, capsys, command):
    path, flags = data
    out = ["--out", str(tmp_path / "never")] if command[0] == "prepack" else []
    assert main([command[0], str(path), *flags, *out, *command[1:], "--on-bad-row", "error"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    # the first bad row met (train meets them in its seeded order): its file and line, and its reason
    assert re.match(rf"sftpack {command[0]}: conversation '{re.escape(str(path))}:[345]': ", err), err
    assert "[template_error]" in err or "[no_trainable_tokens]" in err, err
    assert not (tmp_path / "never").exists()


@pytest.fixture(scope="module")
def strict_model(tmp_path_factory):
    """A user's model folder (a tiny Llama) whose tokenizer carries the STRICT template."""
    import torch

    from sftpack.exactness import tiny_llama
    from sftpack.testing import tiny_chat_tokenizer

    root = tmp_path_factory.mktemp("strict_model")
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = STRICT
    with torch.random.fork_rng(devices=[]):
        tiny_llama(len(tok), seed=3).save_pretrained(root)
    tok.save_pretrained(root)
    return str(root)


def test_verify_leaves_the_same_rows_out_of_every_path_and_says_so(data, strict_model, capsys):
    path, _ = data
    argv = ["verify", str(path), "--model", strict_model, "--paths", "trainer", "offline", "--max-seq-len", "64"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "left out by the tokenizer (--on-bad-row skip): no_trainable_tokens 1, template_error 2" in said, said
    assert f"-> {GOOD} samples" in said and "every path agrees" in said, said
    assert main([*argv, "--on-bad-row", "error"]) == 3  # the data could not be checked: one line
    err = capsys.readouterr().err.strip()
    assert re.search(rf"conversation '{re.escape(str(path))}:3': .*\[template_error\]", err), err
