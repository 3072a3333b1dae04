"""``sftpack inspect DIR --row I --decode``: each sequence of a row as text, its trained tokens
between ``[[`` and ``]]``, each real control token between ``⟦`` and ``⟧``; how a TRL user checks
that a template trains what it should.

The prepacks are made here, by ``sftpack prepack``, from conversations written here, with
the tiny ChatML tokenizer; the text each must decode to is written out by hand from the
conversation (``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, the trained part of an
assistant turn being its content and its ``<|im_end|>``), so no sftpack code builds the
expected value.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from sftpack.cli import main
from sftpack.cli._inspect import marked_text
from sftpack.testing import tiny_chat_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello you"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the thing é"},
        {"role": "assistant", "content": "yes ✓"},
        {"role": "user", "content": "again?"},
        {"role": "assistant", "content": " the you\nthe ing"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "five"},
        {"role": "assistant", "content": "six"},
    ],
    [{"role": "user", "content": "count " * 9}, {"role": "assistant", "content": "one two three " * 4}],
    [
        {"role": "system", "content": "assist"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi"},
    ],
]


def chatml(messages: list[dict[str, str]], trained: set[int]) -> str:
    """The ChatML rendering as ``--decode`` shows it: the assistant messages at the positions
    ``trained`` between ``[[ ]]``, the control tokens between ``⟦ ⟧``."""
    out = ""
    for k, m in enumerate(messages):
        body = m["content"] + "⟦<|im_end|>⟧"
        out += f"⟦<|im_start|>⟧{m['role']}\n" + (f"[[{body}]]" if k in trained else body) + "\n"
    return out


def unmarked(text: str) -> str:
    """``--decode``'s text without its marks: the rendering."""
    for mark in ("[[", "]]", "⟦", "⟧"):
        text = text.replace(mark, "")
    return text


def all_assistant(messages: list[dict[str, str]]) -> set[int]:
    return {k for k, m in enumerate(messages) if m["role"] == "assistant"}


def last_assistant(messages: list[dict[str, str]]) -> set[int]:
    return {max(all_assistant(messages))}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``(tokenizer folder, chat file, {train_on: prepack folder})``."""
    root = tmp_path_factory.mktemp("decode")
    tiny_chat_tokenizer("chatml").save_pretrained(root / "tok")
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    prepacks = {}
    for train_on in ("all_assistant", "last_assistant"):
        out = root / f"{train_on}.prepack"
        argv = ["prepack", str(chat), "--tokenizer", str(root / "tok"), "--out", str(out)]
        assert main([*argv, "--max-seq-len", "128", "--train-on", train_on]) == 0
        prepacks[train_on] = out
    return root / "tok", chat, prepacks


def decoded(prepack, capsys, *extra: str) -> dict[int, tuple[str, int, int]]:
    """Every row's ``--decode`` output: conversation (line number) -> (text, tokens, trained)."""
    meta = json.loads((prepack / "manifest.json").read_text())
    got: dict[int, tuple[str, int, int]] = {}
    capsys.readouterr()
    for row in range(meta["counts"]["rows"]):
        assert main(["inspect", str(prepack), "--row", str(row), "--decode", *extra]) == 0
        out = capsys.readouterr().out
        assert (
            f"\nrow {row} decoded with " in out
            and "(⟦...⟧: control tokens; [[...]]: trained tokens, loss_mask True):" in out
        )
        body = out.split("trained tokens, loss_mask True):\n", 1)[1]
        blocks = re.split(r"^--- ", body, flags=re.M)[1:]
        assert re.fullmatch(rf"end of row {row}: [\d,]+ padding slots not shown\n", blocks[-1])
        for block in blocks[:-1]:
            head, text = block.split("\n", 1)
            m = re.fullmatch(r"[A-Za-z]: .*chat\.jsonl:(\d+), (\d+) tokens, (\d+) trained", head)
            assert m, head
            line = int(m[1])
            assert line not in got  # each conversation in one row, once
            got[line] = (text, int(m[2]), int(m[3]))
    return got


@pytest.mark.parametrize(
    "train_on, marked",
    [("all_assistant", all_assistant), ("last_assistant", last_assistant)],
    ids=["all_assistant", "last_assistant"],
)
def test_decode_is_the_rendering_with_exactly_the_trained_turns_marked(made, capsys, train_on, marked):
    tok_dir, _, prepacks = made
    tok = tiny_chat_tokenizer("chatml")
    got = decoded(prepacks[train_on], capsys)
    assert sorted(got) == list(range(1, len(CONVERSATIONS) + 1))
    for line, (text, tokens, trained) in got.items():
        messages = CONVERSATIONS[line - 1]
        # without the marks, the text is the template's own rendering
        rendering = tok.apply_chat_template(messages, tokenize=False)
        assert unmarked(text) == rendering == unmarked(chatml(messages, set()))
        assert text == chatml(messages, marked(messages))
        assert tokens == len(tok(rendering)["input_ids"])
        assert trained == sum(len(tok(messages[k]["content"] + "<|im_end|>")["input_ids"]) for k in marked(messages))
    # negative control: the other policy's marks are not what this prepack trains
    other = last_assistant if marked is all_assistant else all_assistant
    assert any(
        text != chatml(CONVERSATIONS[line - 1], other(CONVERSATIONS[line - 1])) for line, (text, _, _) in got.items()
    )


def test_the_recorded_tokenizer_and_the_given_one_decode_alike(made, capsys):
    tok_dir, _, prepacks = made
    prepack = prepacks["all_assistant"]
    assert decoded(prepack, capsys) == decoded(prepack, capsys, "--tokenizer", str(tok_dir))


def test_another_tokenizer_is_refused_in_one_line(made, capsys, tmp_path):
    _, _, prepacks = made
    tiny_chat_tokenizer("llama3").save_pretrained(tmp_path / "llama3")
    argv = [
        "inspect",
        str(prepacks["all_assistant"]),
        "--row",
        "0",
        "--decode",
        "--tokenizer",
        str(tmp_path / "llama3"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decode:" in err[0] and "was made with tokenizer" in err[0]
    assert "give --tokenizer DIR (or --model DIR) with the prepack's tokenizer" in err[0]
    assert main(["inspect", str(prepacks["all_assistant"]), "--tokenizer", str(tmp_path / "llama3")]) == 2
    assert "--tokenizer and --model are for --decode" in capsys.readouterr().err


def test_a_run_of_one_special_token_is_shown_collapsed():
    tok = tiny_chat_tokenizer("chatml")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    hi = tok("hello", add_special_tokens=False)["input_ids"]
    ids = np.array([start, *[pad] * 64, *hi, pad, end, end], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    mask[-3:] = True  # the one pad after "hello" and the two ends: a run of two collapses inside the marks
    assert marked_text(tok, ids, mask) == "⟦<|im_start|>⟧⟦<|endoftext|>⟧ x 64hello[[⟦<|endoftext|>⟧⟦<|im_end|>⟧ x 2]]"
    # negative control: one more token trained ("llo", the second of "he" "llo"): one more token marked
    mask[-4] = True
    assert marked_text(tok, ids, mask) == "⟦<|im_start|>⟧⟦<|endoftext|>⟧ x 64he[[llo⟦<|endoftext|>⟧⟦<|im_end|>⟧ x 2]]"


def test_an_image_prepack_decodes_with_its_placeholders_collapsed(tmp_path, capsys):
    """The family's own tokenizer (none given, none recorded): each image's placeholders are one
    ``⟦<|image_pad|>⟧ x N``, N the count the prepack's index gives; only the answers are trained."""
    from PIL import Image

    Image.new("RGB", (56, 84), (200, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (112, 56), (30, 200, 30)).save(tmp_path / "green.png")
    rows = [
        [{"type": "image", "path": "red.png"}, {"type": "text", "text": "Colour?"}],
        [{"type": "text", "text": "And this one?"}, {"type": "image", "path": "green.png"}],
    ]
    with (tmp_path / "images.jsonl").open("w") as f:
        for content, answer in zip(rows, ("Red.", "Green.")):
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}
                )
                + "\n"
            )
    out = tmp_path / "images.prepack"
    assert main(["prepack", str(tmp_path / "images.jsonl"), "--out", str(out), "--max-seq-len", "512"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--decode"]) == 0  # row 0 unless --row says otherwise
    said = capsys.readouterr().out
    placeholders = [int(n) for n in re.findall(r"at slot \d+ \((\d+) placeholders\)", said)]
    assert len(placeholders) == 2 and min(placeholders) >= 1  # both conversations in row 0, one image each
    texts = re.findall(r"^--- [AB]: \S+, [\d,]+ tokens, \d+ trained\n(.*?)(?=^--- )", said, flags=re.M | re.S)
    pads = [f"⟦<|vision_start|>⟧⟦<|image_pad|>⟧ x {n}⟦<|vision_end|>⟧" for n in placeholders]
    assert sorted(texts) == sorted(
        [
            f"⟦<|im_start|>⟧user\n{pads[0]}Colour?⟦<|im_end|>⟧\n⟦<|im_start|>⟧assistant\n[[Red.⟦<|im_end|>⟧]]\n",
            f"⟦<|im_start|>⟧user\nAnd this one?{pads[1]}⟦<|im_end|>⟧\n⟦<|im_start|>⟧assistant\n[[Green.⟦<|im_end|>⟧]]\n",
        ]
    )
