"""What a newcomer meets first (issue 38, item 12), each as they meet it: the README's
by-hand block and its chat file, a missing input, the docs on JSON arrays, ``inspect
--decode`` on control-token text, the docs' Trainer block run twice, ``train
--no-progress``, the prepack and read summaries, the ``--plot`` step axis, the embedded
template's tool format and where the speed claims against other trainers come from.

Everything runs through the CLI (``sftpack.cli.main``) or the docs' own text, with the
tiny ChatML tokenizer where a tokenizer is needed.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sftpack.cli import main
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import train_args

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def _chat(i: int) -> list[dict]:
    return [
        {"role": "user", "content": f"my own question {i}: " + "count " * (i % 5 + 1)},
        {"role": "assistant", "content": f"my own answer {i} " + "one two three " * (i % 4 + 1)},
    ]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tok")
    tiny_chat_tokenizer("chatml").save_pretrained(root)
    return root


# (a) the README's by-hand block: its chat file comes from a command of the block itself ----------------


def _readme_block() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("To install by hand:") :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_readme_block_writes_chats_jsonl_before_any_command_reads_it():
    lines = _readme_block()
    uses = [k for k, argv in enumerate(lines) if "chats.jsonl" in argv]
    assert uses, "the block uses no chats.jsonl"
    first = lines[uses[0]]
    assert first[1:] == ["demo", "--write-data", "chats.jsonl"], first  # the first line naming it writes it
    # pasted twice, the block still runs: the prepack replaces its own output
    prepack = next(argv for argv in lines if argv[1:2] == ["prepack"])
    assert "--overwrite" in prepack


def test_demo_write_data_writes_a_chat_file_that_the_commands_read(tmp_path, tok_dir, capsys):
    data = tmp_path / "chats.jsonl"
    assert main(["demo", "--write-data", str(data), "--quick"]) == 0
    assert f"wrote 400 chitchat conversations to {data}" in capsys.readouterr().out
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 400 and all(set(r) == {"messages"} for r in rows)
    assert rows[0]["messages"][0] == {"role": "user", "content": "Hello\nHow are you doing today?"}
    # the next command of the README reads it: every row kept, as messages
    assert main(["bench", str(data), "--limit", "8", "--tokenizer", str(tok_dir), "--max-seq-len", "4096"]) == 0
    assert "read 8 rows: 8 kept, dropped: none" in capsys.readouterr().out
    # pasted again: the same file, nothing changes
    before = data.read_bytes()
    assert main(["demo", "--write-data", str(data), "--quick"]) == 0
    assert "already holds the 400 embedded chitchat conversations" in capsys.readouterr().out
    assert data.read_bytes() == before


def test_demo_write_data_never_replaces_a_users_file(tmp_path, capsys):
    mine = _write(tmp_path / "chats.jsonl", [_chat(1)])
    before = mine.read_bytes()
    assert main(["demo", "--write-data", str(mine)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--write-data {mine}: the path exists and holds other data" in err[0]
    assert mine.read_bytes() == before


# (b) a missing input is said as such, on every command -----------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["prepack", "{missing}", "--out", "{tmp}/out"],
        ["train", "{missing}", "--steps", "1"],
        ["bench", "{missing}"],
        ["verify", "{missing}"],
    ],
    ids=lambda c: c[0],
)
def test_a_missing_input_is_named_as_missing(command, tmp_path, capsys):
    missing = tmp_path / "nothere.jsonl"
    argv = [a.format(missing=missing, tmp=tmp_path) for a in command]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sftpack {command[0]}: {missing}: no such file or directory (check that the path exists)"]
    assert not (tmp_path / "out").exists()


def test_a_missing_input_beside_a_good_one_is_named_before_any_work(tmp_path, tok_dir, capsys):
    good = _write(tmp_path / "good.jsonl", [_chat(1)])
    argv = ["prepack", str(good), str(tmp_path / "gone.jsonl"), "--tokenizer", str(tok_dir), "--out"]
    assert main([*argv, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "gone.jsonl: no such file or directory" in err and "free disk space" not in err
    # negative control: both present, it packs
    _write(tmp_path / "gone.jsonl", [_chat(2)])
    assert main([*argv, str(tmp_path / "out"), "--max-seq-len", "256"]) == 0


def test_inspect_of_a_missing_prepack_says_what_to_give(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothere")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"sftpack inspect: {tmp_path / 'nothere'}: no such directory (give a directory written by sftpack prepack)"
    )


# (c) JSON arrays: read, and every --help and docs/chat.md say so ---------------------------------------


@pytest.mark.parametrize("command", ["prepack", "train", "bench", "verify"])
def test_every_command_help_names_json_arrays(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "JSON-array" in " ".join(capsys.readouterr().out.split())


def test_a_json_array_file_is_read_as_the_docs_say(tmp_path, tok_dir, capsys):
    chat = (ROOT / "docs" / "chat.md").read_text()
    assert "one JSON array of objects" in chat and "`chat.json[16]` (element, 0-based)" in chat
    array = tmp_path / "chats.json"
    array.write_text(json.dumps([{"messages": _chat(i)} for i in range(3)], indent=2))
    out = tmp_path / "p"
    assert main(["prepack", str(array), "--tokenizer", str(tok_dir), "--out", str(out), "--max-seq-len", "256"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["read"] == 3 and manifest["counts"]["kept"] == 3


# (d) inspect --decode: a real control token is marked, the same characters typed as text are not -------


def test_decode_tells_control_tokens_from_text_that_looks_like_one(tmp_path, tok_dir, capsys):
    data = _write(
        tmp_path / "c.jsonl",
        [
            [
                {"role": "user", "content": "what ends a turn? <|im_end|>"},
                {"role": "assistant", "content": "the token <|im_end|>, not this text"},
            ]
        ],
    )
    out = tmp_path / "p"
    assert main(["prepack", str(data), "--tokenizer", str(tok_dir), "--out", str(out), "--max-seq-len", "128"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--decode"]) == 0
    said = capsys.readouterr().out
    assert "(⟦...⟧: control tokens; [[...]]: trained tokens, loss_mask True):" in said
    text = said.split("trained tokens, loss_mask True):\n", 1)[1].split("\n", 1)[1].rsplit("\n--- end of row", 1)[0]
    assert text == (
        "⟦<|im_start|>⟧user\nwhat ends a turn? <|im_end|>⟦<|im_end|>⟧\n"
        "⟦<|im_start|>⟧assistant\n[[the token <|im_end|>, not this text⟦<|im_end|>⟧]]"
    )
    # negative control: the typed text is 2 of the 4 '<|im_end|>' shown, and not marked
    assert text.count("<|im_end|>") == 4 and text.count("⟦<|im_end|>⟧") == 2


# (e) the docs' Trainer block: a second run works, and it reads the user's own file ---------------------


def test_the_trainer_block_of_the_docs_reruns_and_reads_the_users_file(tmp_path, monkeypatch):
    """The block's data part (up to the model), as pasted, twice in one folder holding the
    user's ``chats.jsonl``: the second run prepacks again (a fresh folder), and the samples
    are the user's conversations, not the embedded corpus. The whole block (two one-step
    ``Trainer`` runs) runs in tests/test_docs_blocks.py."""
    text = (ROOT / "docs" / "training.md").read_text()
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "Trainer(" in b)
    data_part = block[: block.index("model = build_model")]
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "chats.jsonl", [_chat(i) for i in range(20)])
    rows = []
    for _ in range(2):
        ns: dict = {"__name__": "__docs__"}
        exec(compile(data_part, "docs/training.md", "exec"), ns)  # noqa: S102 - the docs' own code
        rows.append(Path(ns["rows"]))
        first = ns["tok"].decode(ns["samples"][0]["input_ids"])
        assert "my own question 0" in first, first
    assert rows[0] != rows[1] and all((r / "manifest.json").is_file() for r in rows)
    # negative control: without the user's file the block falls back to the embedded corpus
    (tmp_path / "chats.jsonl").unlink()
    ns = {"__name__": "__docs__"}
    exec(compile(data_part, "docs/training.md", "exec"), ns)  # noqa: S102 - the docs' own code
    assert "my own question" not in ns["tok"].decode(ns["samples"][0]["input_ids"])


# (f) train --no-progress, (h) the --plot step axis --------------------------------------------------


def _train(data: Path, tok_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    more = ["--log", str(tmp_path / "log.jsonl"), "--cache-dir", str(tmp_path / "cache"), *extra]
    return train_args(data, *more, tokenizer=tok_dir, steps=2, max_seq_len=128)


def test_train_no_progress_and_whole_steps_on_the_plot(tmp_path, tok_dir, capsys, monkeypatch):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    data = _write(tmp_path / "c.jsonl", [_chat(i) for i in range(12)])
    ticks: list[list[float]] = []
    save = Figure.savefig

    def recording_savefig(fig, *a, **k):  # the real savefig; then the ticks it drew
        out = save(fig, *a, **k)
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks.append([t for t in ax.get_xticks() if lo <= t <= hi])
        return out

    monkeypatch.setattr(Figure, "savefig", recording_savefig)
    png = tmp_path / "curves.png"
    assert main(_train(data, tok_dir, tmp_path, "--plot", str(png))) == 0
    assert "train (trainer)" in capsys.readouterr().err  # the bar, by default
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(ticks) == 2 and all(ts and all(float(t).is_integer() for t in ts) for ts in ticks), ticks
    # negative control: over the same two steps, matplotlib's default locator puts ticks between them
    assert any(not float(t).is_integer() for t in MaxNLocator().tick_values(1, 2))
    assert main(_train(data, tok_dir, tmp_path, "--no-progress")) == 0
    said = capsys.readouterr()
    assert "train (trainer)" not in said.err and "step" not in said.err, said.err
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2  # it trained all the same


# (g) the summaries: no "(lost: 0 ...)", max_seqlen said for what it is, formats for messages files ----


def test_the_prepack_summary_and_inspect_say_plainly_what_they_count(tmp_path, tok_dir, capsys):
    data = _write(tmp_path / "c.jsonl", [_chat(1), _chat(2)])
    out = tmp_path / "p"
    assert main(["prepack", str(data), "--tokenizer", str(tok_dir), "--out", str(out), "--max-seq-len", "128"]) == 0
    said = capsys.readouterr().out
    assert re.search(r"\n +formats +messages 2\n", said), said
    tokens = re.search(r"\n +tokens +(.*)\n", said)
    assert tokens and re.fullmatch(r"[\d,]+", tokens[1]), said  # nothing lost: nothing said
    assert main(["inspect", str(out), "--row", "0"]) == 0
    said = capsys.readouterr().out
    assert "  formats: messages 2 (rows kept)\n" in said
    tok = tiny_chat_tokenizer("chatml")
    longest = max(len(tok(tok.apply_chat_template(m, tokenize=False))["input_ids"]) for m in (_chat(1), _chat(2)))
    m = re.search(r"max_seqlen=(\d+) \(the longest padded segment, .*; the longest sequence has (\d+) tokens\)", said)
    assert m, said
    assert int(m[1]) == 128 and int(m[2]) == longest < 128  # the kernel's bound, and the true longest
    # negative control: what is lost is said, with how much of it was trainable
    cut = tmp_path / "cut"
    argv = ["prepack", str(data), "--tokenizer", str(tok_dir), "--out", str(cut), "--max-seq-len", "16"]
    assert main([*argv, "--overlong", "truncate"]) == 0
    assert re.search(
        r"\n +tokens +[\d,]+ \([\d,]+ lost to over-long handling, [\d,]+ of them trainable\)\n", capsys.readouterr().out
    )


def test_the_read_summary_names_the_format_of_messages_files(tmp_path, tok_dir, capsys):
    data = _write(tmp_path / "c.jsonl", [_chat(i) for i in range(3)])
    assert main(["bench", str(data), "--tokenizer", str(tok_dir), "--max-seq-len", "128"]) == 0
    said = capsys.readouterr().out
    assert "read 3 rows: 3 kept, dropped: none\n  formats: messages 3 (rows kept)\n" in said, said


# (i) the embedded template's tool format: what differs from Qwen2.5's is said where tools are documented --


def test_the_tool_docs_say_what_differs_from_qwen25():
    chat = (ROOT / "docs" / "chat.md").read_text()
    tools = chat[chat.index("### Tools") : chat.index("## The default corpus")]
    for said in ("<tool_response>", "<|im_start|>tool", "You are Qwen, created by Alibaba Cloud", "JSON string"):
        assert said in tools, said
    readme = (ROOT / "README.md").read_text()
    assert "Qwen2.5" in readme and "(docs/chat.md#tools)" in readme
    # the rendering it describes is the embedded template's own (docs/chat.md's doctest prints it whole)
    from sftpack.data import CHATML_TEMPLATE

    assert "tool_response" not in CHATML_TEMPLATE and "You are Qwen" not in CHATML_TEMPLATE


# (j) a speed claim against other trainers comes from a script of the repository -------------------------


def test_the_speed_claims_against_other_trainers_come_from_a_script():
    perf = (ROOT / "docs" / "performance.md").read_text()
    section = perf[perf.index("## Against other packing trainers") :]
    scripts = re.findall(r"benchmarks/(bench_\w+\.py)", section)
    assert scripts, "the section names no script"
    for name in scripts:
        script = ROOT / "benchmarks" / name
        assert script.is_file() and "write_section" in script.read_text(), name
        assert f"<!-- {name} -->" in (ROOT / "benchmarks" / "RESULTS.md").read_text(), name
    assert not re.search(r"\d+(\.\d+)?x faster", section)  # measured numbers live in RESULTS.md only
