"""Fingerprints on their own (``_fingerprint``): a tokenizer's is stable across copies and
changes with anything that changes the ids or masks; an input folder's covers every
file's content, in a fixed order."""

from __future__ import annotations

import copy

import pytest

from sftpack.offline._fingerprint import input_fingerprints, pad_id_of, tokenizer_fingerprint
from sftpack.testing import tiny_chat_tokenizer


def test_a_tokenizer_fingerprint_is_stable_and_follows_the_template(tok, tmp_path):
    fp = tokenizer_fingerprint(tok)
    tok.save_pretrained(tmp_path / "t")
    from transformers import AutoTokenizer

    again = tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tmp_path / "t"), local_files_only=True))
    assert again["sha256"] == fp["sha256"] and again["vocab_size"] == fp["vocab_size"] == len(tok)
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
    changed = tokenizer_fingerprint(other)
    assert changed["sha256"] != fp["sha256"] and changed["content_sha256"] == fp["content_sha256"]
    assert changed["chat_template_sha256"] != fp["chat_template_sha256"]
    assert tokenizer_fingerprint(tiny_chat_tokenizer("llama3"))["sha256"] != fp["sha256"]


def test_a_slow_tokenizer_is_refused_and_the_pad_id_falls_back_in_order():
    class Slow:
        pad_token_id = None
        eos_token_id = 7

    with pytest.raises(TypeError, match="Slow is not a Hugging Face fast tokenizer"):
        tokenizer_fingerprint(Slow())
    assert pad_id_of(Slow()) == 7  # no pad token: the end-of-sequence token
    Slow.pad_token_id = 0  # 0 is a pad id like any other
    assert pad_id_of(Slow()) == 0
    Slow.pad_token_id = Slow.eos_token_id = None
    assert pad_id_of(Slow()) == 0


def test_a_folder_is_fingerprinted_by_every_file_in_sorted_order(tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.jsonl").write_text("bb\n")
    (folder / "sub" / "a.jsonl").write_text("a\n")
    (fp,) = input_fingerprints([folder])
    assert fp["name"] == str(folder) and fp["size"] == 5 and len(fp["sha256"]) == 64
    (folder / "sub" / "a.jsonl").write_text("A\n")  # same size, one byte changed
    assert input_fingerprints([folder])[0]["sha256"] != fp["sha256"]
    single = input_fingerprints([folder / "b.jsonl"])[0]
    assert single["size"] == 3 and single["sha256"] != fp["sha256"]
