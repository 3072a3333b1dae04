"""The command line speaks in its own terms, with one set of defaults.

Every fix a command prints names a flag (``--split NAME``, ``--chat-template FILE``,
``--on-bad-row``), the flags do what they say end to end, every command that reads chat
files has the same ``--on-bad-row`` and ``--max-seq-len`` defaults and says so in its
``--help``, and the help tells the truth about what ``--overlong split`` costs (the count
``bench`` prints is the tokenizer's ``split_labels_lost``). The data, tokenizer folders and
templates are made here: a saved ``DatasetDict`` with two splits, a tiny tokenizer saved
without a chat template, a JSONL file with one bad line.
"""

from __future__ import annotations

import json
import re

import pytest

from sftpack.chat import read_conversations, tokenize_conversations
from sftpack.chat._options import DEFAULT_MAX_SEQ_LEN, DEFAULT_ON_BAD_ROW
from sftpack.cli import build_parser, main
from sftpack.data import CHATML_TEMPLATE
from sftpack.testing import tiny_chat_tokenizer

#: the commands that read chat files, and the arguments each needs to parse
READERS = {"prepack": ["--out", "x"], "train": [], "bench": [], "verify": []}
#: a template of another shape than ChatML: the same contents, other text around them
PLAIN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }} says:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant says:\n{% endif %}"
)


def _conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "hi " * (i + 1)},
            {"role": "assistant", "content": "yo " * (2 * i + 3)},
        ]
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A two-split DatasetDict folder (train 6, test 2), a JSONL file with one bad line, a tiny
    tokenizer folder without a chat template, and two template files."""
    import datasets

    root = tmp_path_factory.mktemp("terms")
    train = [_conversation(i) for i in range(6)]
    test = [_conversation(i) for i in range(10, 12)]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(root / "dd"))
    (root / "bad.jsonl").write_text("".join(json.dumps(c) + "\n" for c in train) + "{not json\n")
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = None
    tok.save_pretrained(root / "notemplate")
    (root / "chatml.jinja").write_text(CHATML_TEMPLATE)
    (root / "plain.jinja").write_text(PLAIN_TEMPLATE)
    return root


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1
    return err[-1]


@pytest.mark.parametrize("command", ["prepack", "bench", "verify", "train"])
def test_a_datasetdict_without_split_names_the_flag(data, tmp_path, command, capsys):
    argv = [command, str(data / "dd"), *(["--out", str(tmp_path / "out")] if command == "prepack" else [])]
    if command == "train":
        argv += ["--steps", "1", "--no-cache", "--device", "cpu"]
    assert main(argv) == (3 if command == "verify" else 1)  # verify: 3, the data could not be checked
    line = _one_error_line(capsys)
    assert line.startswith(f"sftpack {command}: ")
    assert "splits train, test" in line and "(--split NAME; split= in Python)" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["prepack", "bench", "train"])
def test_a_tokenizer_without_a_template_names_the_flag(data, tmp_path, command, capsys):
    argv = [command, str(data / "bad.jsonl"), "--tokenizer", str(data / "notemplate")]
    argv += {"prepack": ["--out", str(tmp_path / "out"), "--no-progress"], "bench": []}.get(
        command, ["--steps", "1", "--no-cache", "--device", "cpu"]
    )
    assert main(argv) == 1
    line = _one_error_line(capsys)
    assert "has no chat template" in line and "--chat-template FILE" in line, line
    assert "TokenizersBackend" not in line and "PreTrainedTokenizerFast" not in line, line


def test_a_bad_row_is_skipped_and_counted_by_default_and_the_output_names_the_flag(data, capsys):
    tok = ["--tokenizer", str(data / "notemplate"), "--chat-template", str(data / "chatml.jinja")]
    assert main(["bench", str(data / "bad.jsonl"), *tok]) == 0
    out = capsys.readouterr().out
    assert "read 7 rows: 6 kept, dropped: invalid_json 1" in out
    assert "--on-bad-row error stops at the first" in out
    assert main(["bench", str(data / "bad.jsonl"), *tok, "--on-bad-row", "error"]) == 1  # negative control
    line = _one_error_line(capsys)
    assert "bad.jsonl, line 7" in line and "--on-bad-row skip" in line, line


def _manifest(path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_split_and_chat_template_work_end_to_end_in_prepack(data, tmp_path):
    """--split reads the named split (recorded in the manifest); --chat-template renders with the
    file's template: the prepack holds exactly the tokens the library gives with it, and another
    template gives other tokens."""
    import datasets

    tok_args = ["--tokenizer", str(data / "notemplate")]
    counts = {}
    for split in ("train", "test"):
        out = tmp_path / split
        argv = ["prepack", str(data / "dd"), "--split", split, "--out", str(out), "--no-progress"]
        assert main([*argv, *tok_args, "--chat-template", str(data / "plain.jinja")]) == 0
        m = _manifest(out)
        assert m["fingerprint"]["split"] == split
        counts[split] = m["counts"]
    dd = datasets.load_from_disk(str(data / "dd"))
    assert {s: c["read"] for s, c in counts.items()} == {s: len(dd[s]) for s in ("train", "test")}

    def library_tokens(template: str, split: str) -> int:
        tok = tiny_chat_tokenizer("chatml")
        tok.chat_template = template
        out = tokenize_conversations(read_conversations(str(data / "dd"), split=split), tok)
        return sum(len(s) for s in out)

    assert counts["test"]["tokens"] == library_tokens(PLAIN_TEMPLATE, "test")
    assert counts["test"]["tokens"] != library_tokens(CHATML_TEMPLATE, "test")  # the template mattered


def test_train_reads_the_split_with_the_template(data, capsys):
    argv = ["train", str(data / "dd"), "--split", "test", "--tokenizer", str(data / "notemplate")]
    argv += ["--chat-template", str(data / "plain.jinja"), "--steps", "1", "--batch-size", "2", "--no-cache"]
    argv += ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--device", "cpu", "--num-proc", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"data: 2 conversations -> 2 samples", out), out


def test_bench_counts_the_labels_split_points_cost(data, capsys):
    """The help says each split point costs at most one supervised label, counted as
    split_labels_lost: bench prints the tokenizer's own count, and it is not zero here."""
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = CHATML_TEMPLATE
    out = tokenize_conversations(read_conversations(str(data / "bad.jsonl"), on_bad_row="skip"), tok, max_seq_len=8)
    list(out)  # the stats fill in as it runs
    stats = out.stats
    assert stats.split_labels_lost > 0
    argv = ["bench", str(data / "bad.jsonl"), "--tokenizer", str(data / "notemplate")]
    assert main([*argv, "--chat-template", str(data / "chatml.jinja"), "--max-seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert f"({stats.split_labels_lost:,} at split points: split_labels_lost)" in out, out


def _help(command: str) -> dict[str, str]:
    """``--flag`` -> its help text, as ``sftpack COMMAND --help`` shows it."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    text = " ".join(sub.format_help().split())
    return {a.option_strings[0]: " ".join(a.help.split()) for a in sub._actions if a.option_strings and a.help} | {
        "": text
    }


def test_every_command_has_and_states_the_same_defaults():
    from sftpack.cli._train import run_config

    for command, extra in READERS.items():
        helps = _help(command)
        assert f"(default {DEFAULT_ON_BAD_ROW})" in helps["--on-bad-row"], command
        assert "--split" in helps and "--on-bad-row" in helps
        args = build_parser().parse_args([command, *extra])
        assert args.on_bad_row == DEFAULT_ON_BAD_ROW.value, command
        assert not re.search(r"loses? nothing|nothing lost", helps[""]), command
        if command == "verify":  # a check's width, said in its help, beside the commands' default
            assert f"default to {DEFAULT_MAX_SEQ_LEN}" in helps["--max-seq-len"]
            continue
        assert "--chat-template" in helps
        assert f"default {DEFAULT_MAX_SEQ_LEN}" in helps["--max-seq-len"], command
        if command == "train":  # what a run without --prepacked gets
            args.max_seq_len = run_config(args).train.max_seq_len
        assert args.max_seq_len == DEFAULT_MAX_SEQ_LEN, command
    for command in ("prepack", "bench"):
        assert "split_labels_lost" in _help(command)["--overlong"]


def test_train_reports_the_rows_the_reader_left_out(tmp_path, capsys):
    """The reader runs in train's background tokenizer process; its counts come back with the
    samples and the command prints them (the library itself logs nothing above debug)."""
    good = [
        json.dumps({"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]})
        for i in range(8)
    ]
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join([*good, "{not json", json.dumps({"messages": []})]) + "\n")
    args = ["train", str(data), "--steps", "1", "--max-seq-len", "64", "--dim", "16", "--layers", "1", "--heads", "2"]
    args += [
        "--kv-heads",
        "1",
        "--batch-size",
        "4",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--log",
        str(tmp_path / "l"),
    ]
    assert main(args) == 0
    said = capsys.readouterr()
    assert "read 10 rows: 8 kept, dropped: empty_messages 1, invalid_json 1" in said.out, said.out
    assert "invalid_json" not in said.err  # not logged by the library as well
