"""The formats SFT data comes in besides ``messages``: Alpaca, TRL's prompt/completion (standard and
conversational), plain ``text`` and JSON-array files; each detected from the data, counted, and trained
on exactly what its rule says (checked by decoding the trained tokens), from the library and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sftpack.chat import (
    BadFileError,
    BadRowError,
    encode_conversation,
    read_conversations,
    tokenize_conversations,
)
from sftpack.cli import main
from sftpack.testing import tiny_chat_tokenizer

END = "<|im_end|>"  # ChatML's end of turn, and the tiny ChatML tokenizer's EOS

ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "five"},
    {"instruction": "Say hi.", "input": "", "output": "hi there", "system": "Be kind."},
    {"instruction": "Name a colour.", "output": "red"},  # no input at all
]
PROMPT_COMPLETION = [
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "", "completion": "all of it"},  # an empty prompt: the whole row trained
]
CONVERSATIONAL = [
    {
        "prompt": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},  # in the prompt: never trained
            {"role": "user", "content": "again"},
        ],
        "completion": [{"role": "assistant", "content": "ok then"}],
    },
    {"prompt": [{"role": "user", "content": "one"}], "completion": [{"role": "assistant", "content": "two"}]},
]
TEXT = [{"text": "hello world"}, {"text": "a line with <|im_end|> typed in it"}]


def _chat(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}{END}\n" for m in messages)


#: format -> (rows, each row's whole rendering, each row's trained text), by the rules the docs state
CASES: dict[str, tuple[list[dict[str, Any]], list[str], list[str]]] = {
    "alpaca": (
        ALPACA,
        [
            _chat(
                [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "five"}]
            ),
            _chat(
                [
                    {"role": "system", "content": "Be kind."},
                    {"role": "user", "content": "Say hi."},
                    {"role": "assistant", "content": "hi there"},
                ]
            ),
            _chat([{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "red"}]),
        ],
        [f"five{END}", f"hi there{END}", f"red{END}"],
    ),
    "prompt_completion": (
        PROMPT_COMPLETION,
        [f"The sky is blue.{END}", f"all of it{END}"],
        [f" blue.{END}", f"all of it{END}"],
    ),
    "conversational_prompt_completion": (
        CONVERSATIONAL,
        [
            _chat([*CONVERSATIONAL[0]["prompt"], *CONVERSATIONAL[0]["completion"]]),
            _chat([*CONVERSATIONAL[1]["prompt"], *CONVERSATIONAL[1]["completion"]]),
        ],
        [f"ok then{END}", f"two{END}"],
    ),
    "text": (TEXT, [f"{r['text']}{END}" for r in TEXT], [f"{r['text']}{END}" for r in TEXT]),
}


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_chat_tokenizer("chatml")


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _trained(tok: Any, ids: np.ndarray, mask: np.ndarray) -> str:
    return tok.decode(np.asarray(ids)[np.asarray(mask, dtype=bool)])


@pytest.mark.parametrize("fmt", list(CASES))
def test_each_format_from_the_library_trains_exactly_its_rule(tmp_path: Path, tok: Any, fmt: str) -> None:
    rows, whole, trained = CASES[fmt]
    reader = read_conversations(_write(tmp_path / "d.jsonl", rows))
    out = tokenize_conversations(reader, tok)
    samples = list(out)
    assert [tok.decode(s.input_ids) for s in samples] == whole
    assert [_trained(tok, s.input_ids, s.loss_mask) for s in samples] == trained
    assert reader.stats.formats == {fmt: len(rows)} and reader.stats.as_dict()["formats"] == {fmt: len(rows)}
    # each row trains one run of tokens (its last turn): nothing of the prompt before it
    for s in samples:
        assert (np.diff(np.flatnonzero(s.loss_mask)) == 1).all()
    # the same rows given to the tokenizer directly (not read from a file) come out the same
    again = list(tokenize_conversations(rows, tok))
    assert [s.input_ids.tolist() for s in again] == [s.input_ids.tolist() for s in samples]
    assert [s.loss_mask.tolist() for s in again] == [s.loss_mask.tolist() for s in samples]


def test_the_prompt_is_what_stays_untrained(tok: Any) -> None:
    """Negative controls of the rules above: the same turns as a ``messages`` row train the
    prompt's assistant turn, and ``train_on='everything'`` trains a plain prompt."""
    conv = CONVERSATIONAL[0]
    as_messages = encode_conversation({"messages": conv["prompt"] + conv["completion"]}, tok).samples[0]
    as_prompt = encode_conversation(conv, tok).samples[0]
    assert as_messages.input_ids.tolist() == as_prompt.input_ids.tolist()
    assert _trained(tok, as_messages.input_ids, as_messages.loss_mask) == f"yo{END}ok then{END}"
    assert _trained(tok, as_prompt.input_ids, as_prompt.loss_mask) == f"ok then{END}"
    everything = encode_conversation(PROMPT_COMPLETION[0], tok, train_on="everything").samples[0]
    assert everything.loss_mask.all() and not encode_conversation(PROMPT_COMPLETION[0], tok).samples[0].loss_mask.all()


def test_plain_text_is_tokenized_as_trl_does(tok: Any) -> None:
    """TRL tokenizes ``prompt`` and ``prompt + completion`` with ``tokenizer(text)`` (BOS where the
    tokenizer adds one) and appends EOS unless the text ends with it; special-token text typed in
    a content stays text."""
    from tokenizers import processors

    bos_tok = tiny_chat_tokenizer("llama3")
    bos_id, eos_id = bos_tok.bos_token_id, bos_tok.eos_token_id
    bos_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_tok.bos_token} $A", special_tokens=[(bos_tok.bos_token, bos_id)]
    )
    assert bos_tok("hi").input_ids[0] == bos_id  # this tokenizer adds BOS, as Llama's do
    for t in (bos_tok, tok):
        row = PROMPT_COMPLETION[0]
        s = encode_conversation(row, t).samples[0]
        n_prompt = len(t(row["prompt"]).input_ids)
        assert s.input_ids.tolist() == t(row["prompt"] + row["completion"]).input_ids + [t.eos_token_id]
        assert s.loss_mask.tolist() == [False] * n_prompt + [True] * (len(s) - n_prompt)
    # no second EOS after a text that ends with it
    s = encode_conversation({"text": "done" + bos_tok.eos_token}, bos_tok).samples[0]
    assert s.input_ids.tolist() == [bos_id, *bos_tok("done", add_special_tokens=False).input_ids, eos_id]
    assert s.loss_mask.all()  # a text row: every token
    # "<|im_end|>" typed inside a text row is text: the one control token is the EOS at the end
    s = encode_conversation(TEXT[1], tok).samples[0]
    assert s.input_ids.tolist().count(tok.eos_token_id) == 1 and s.input_ids[-1] == tok.eos_token_id
    control = encode_conversation(TEXT[1], tok, special_tokens_in_content="control").samples[0]
    assert control.input_ids.tolist().count(tok.eos_token_id) == 2  # the negative control


def test_plain_rows_need_no_chat_template(tok: Any) -> None:
    base = tiny_chat_tokenizer("chatml")
    base.chat_template = None
    out = tokenize_conversations([*TEXT, *PROMPT_COMPLETION], base)
    assert [_trained(base, s.input_ids, s.loss_mask) for s in out] == [
        *CASES["text"][2],
        *CASES["prompt_completion"][2],
    ]
    with pytest.raises(ValueError, match="no chat template"):  # a row that needs one still says so
        list(tokenize_conversations([ALPACA[0]], base))


def test_json_array_files_read_like_json_lines(tmp_path: Path, tok: Any) -> None:
    arr = tmp_path / "alpaca.json"
    arr.write_text(json.dumps(ALPACA, indent=2))
    reader = read_conversations(arr)
    convs = list(reader)
    assert [c.id for c in convs] == [f"{arr}[{i}]" for i in range(3)]
    jsonl = list(read_conversations(_write(tmp_path / "alpaca.jsonl", ALPACA)))
    assert [c.messages for c in convs] == [c.messages for c in jsonl]
    bad_row = [*ALPACA, {"instruction": "x"}]
    arr.write_text(json.dumps(bad_row, indent=2))
    with pytest.raises(BadRowError) as info:
        list(read_conversations(arr))
    assert f"{arr}, item 3 (line 1" in str(info.value) and "'output' is missing" in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(ALPACA, indent=2)[:-3])
    with pytest.raises(BadFileError) as err:
        list(read_conversations(broken))
    msg = str(err.value)
    assert msg.startswith(f"{broken}: is a JSON array that does not parse") and "line " in msg and "column" in msg
    assert "--on-bad-row skip" in msg
    skip = read_conversations([broken, arr], on_bad_row="skip")
    assert len(list(skip)) == 3 and skip.stats.files_skipped == {"malformed_json": 1}


BAD = [
    ({"instruction": "Add.", "input": "2 3"}, "missing_field", "'output' is missing in an Alpaca row"),
    ({"instruction": 5, "output": "x"}, "non_string_content", "'instruction' is a number"),
    (
        {"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]},
        "non_string_content",
        "'completion' is a list",
    ),
    ({"prompt": [{"role": "user", "content": "q"}]}, "missing_field", "'completion' is missing"),
    (
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
        "no_assistant_turn",
        "in 'completion': none of the 1 messages is from the assistant",
    ),
    ({"text": "   "}, "empty_content", "'text' is empty in a text row"),
    ({"text": ["a"]}, "non_string_content", "'text' is a list"),
]


@pytest.mark.parametrize(("row", "reason", "phrase"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_a_malformed_row_names_file_line_field_and_the_cli_fix(
    tmp_path: Path, tok: Any, row: dict[str, Any], reason: str, phrase: str
) -> None:
    good = {"text": "fine"} if "text" in row else ALPACA[0] if "instruction" in row else None
    good = good or ({"prompt": "q", "completion": "a"} if isinstance(row.get("prompt"), str) else CONVERSATIONAL[1])
    path = _write(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(BadRowError) as info:
        list(read_conversations(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}, line 2: ") and phrase in msg and f"[{reason}]" in msg
    assert "Fix: " in msg and "--on-bad-row skip" in msg
    skip = read_conversations(path, on_bad_row="skip")
    assert len(list(skip)) == 1 and skip.stats.dropped == {reason: 1}
    with pytest.raises(BadRowError, match=phrase.replace("(", r"\(").replace(")", r"\)")):  # the tokenizer's checks
        list(tokenize_conversations([row], tok))


def test_mixed_formats_in_one_file_are_refused_naming_the_line_and_both(tmp_path: Path) -> None:
    msg_row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path = _write(tmp_path / "mix.jsonl", [ALPACA[0], ALPACA[1], msg_row, TEXT[0]])
    with pytest.raises(BadRowError) as info:
        list(read_conversations(path))
    msg = str(info.value)
    assert msg.startswith(f"{path}, line 3: a messages row, but the file's first row (line 1) is alpaca")
    assert "[mixed_formats]" in msg and "--on-bad-row skip" in msg
    skip = read_conversations(path, on_bad_row="skip")
    assert [c.id for c in skip] == [f"{path}:1", f"{path}:2"]
    assert skip.stats.dropped == {"mixed_formats": 2} and skip.stats.formats == {"alpaca": 2}
    # each file has its own format; messages and ShareGPT rows mix as they always did
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    other = _write(tmp_path / "chat.jsonl", [msg_row, sharegpt])
    both = read_conversations([_write(tmp_path / "a.jsonl", ALPACA), other])
    assert len(list(both)) == 5 and both.stats.formats == {"alpaca": 3, "messages": 1, "sharegpt": 1}


def test_parquet_reads_the_columns_of_its_format(tmp_path: Path, tok: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ALPACA), tmp_path / "a.parquet")  # 'input' / 'system' null where absent
    pq.write_table(pa.Table.from_pylist(TEXT), tmp_path / "t.parquet")
    reader = read_conversations([tmp_path / "a.parquet", tmp_path / "t.parquet"])
    out = tokenize_conversations(reader, tok)
    assert [_trained(tok, s.input_ids, s.loss_mask) for s in out] == [*CASES["alpaca"][2], *CASES["text"][2]]
    assert reader.stats.formats == {"alpaca": 3, "text": 2}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tiny_chat_tokenizer("chatml").save_pretrained(path)
    return path


def _prepack(tmp_path: Path, tok_dir: Path, rows: list[dict[str, Any]]) -> tuple[Path, Path]:
    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "data.json"  # a JSON array file
    data.write_text(json.dumps(rows, indent=1))
    out = tmp_path / "pp"
    argv = ["prepack", str(data), "--out", str(out), "--tokenizer", str(tok_dir), "--max-seq-len", "256"]
    assert main([*argv, "--on-bad-row", "error", "--no-progress"]) == 0
    return data, out


@pytest.mark.parametrize("fmt", ["alpaca", "prompt_completion", "conversational_prompt_completion", "text"])
def test_each_format_end_to_end_from_the_cli(tmp_path: Path, tok: Any, tok_dir: Path, fmt: str) -> None:
    from sftpack.offline import PrepackedDataset

    rows, whole, trained = CASES[fmt]
    data, out = _prepack(tmp_path, tok_dir, rows)
    ds = PrepackedDataset(out)
    got: dict[str, tuple[str, str]] = {}
    for r in range(ds.num_rows):
        ids, mask, seqs = ds.row_arrays(r)
        at = 0
        for rec in seqs:
            n = int(rec["length"])
            cid = str(ds.conversation_id(int(rec["conversation"])))
            got[cid] = (tok.decode(ids[at : at + n]), _trained(tok, ids[at : at + n], mask[at : at + n]))
            at += n
    assert got == {f"{data}[{i}]": (w, t) for i, (w, t) in enumerate(zip(whole, trained))}


def test_inspect_names_the_format(tmp_path: Path, tok_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The manifest's counts carry the reader's ``formats`` (offline's ``reading_counts``), and
    ``sftpack inspect`` names them; plain ``messages`` data too (issue 38: the line was missing)."""
    _, out = _prepack(tmp_path, tok_dir, [*ALPACA, *ALPACA[:1]])
    said = capsys.readouterr().out
    assert re.search(r"\n +formats +alpaca 4\n", said), said  # the prepack summary names them too
    assert main(["inspect", str(out)]) == 0
    assert "  formats: alpaca 4 (rows kept)\n" in capsys.readouterr().out
    msgs = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    _, plain = _prepack(tmp_path / "m", tok_dir, msgs)
    capsys.readouterr()
    assert main(["inspect", str(plain)]) == 0
    assert "  formats: messages 1 (rows kept)\n" in capsys.readouterr().out
