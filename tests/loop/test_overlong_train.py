"""``sftpack train --overlong {split,truncate,drop,error}`` (issue 42, item 2): the training job's
tokenization follows the flag, as ``sftpack prepack``'s does.

Preference pairs: the five pairs of tests/helpers.py and two over-long ones (a long chosen answer, a
prompt that alone fills the row) at ``--max-seq-len 24``. A pair follows the flag whole: ``drop``
leaves both over-long pairs out (counted as 2 dropped conversations; the step trains the 5 others),
``truncate`` cuts the long answer's member to its head (1 truncated) and drops the pair whose members
would keep no answer (1 dropped; the step trains 6 pairs), the default ``split`` refuses the pair by
name with the fix: both flags.

SFT: the 40 chats of the ``chat`` fixture at ``--max-seq-len 64``: ``--overlong drop`` leaves out each
over-long conversation (counted), ``truncate`` keeps each one's head (counted), the default still
splits them (every token kept). The cache: a
default run's key is the key of before (the options it hashes are unchanged), a ``drop`` run writes
its own entry beside the default run's and reads it back the next time. The eval set is tokenized
by the same rule.

Data with images and a ``--prepacked`` folder were tokenized elsewhere: ``--overlong`` other than the
default is refused there in one line.
"""

from __future__ import annotations

import json
import re

import pytest

from sftpack.chat import read_conversations, start_training_samples, tokenize_conversations
from sftpack.chat._cache_key import cache_key, source_identity, tokenizer_identity
from sftpack.cli import main
from sftpack.loop import RunConfig
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import PREFERENCE_PAIRS

pytest.importorskip("transformers")

SMALL = ["--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--no-progress", "--vocab", "data"]
LONG_ANSWER = {"prompt": "Tell a story.", "chosen": " Once" + " upon a time" * 12 + ".", "rejected": " No."}
LONG_PROMPT = {"prompt": "Repeat: " + "la " * 40, "chosen": " la", "rejected": " no"}


def test_preference_pairs_follow_overlong_whole(tmp_path, capsys) -> None:
    path = tmp_path / "prefs.jsonl"
    rows = [*PREFERENCE_PAIRS, LONG_ANSWER, LONG_PROMPT]
    path.write_text("".join(json.dumps(p) + "\n" for p in rows), encoding="utf-8")
    n = len(PREFERENCE_PAIRS)

    def train(*flags: str, batch: int) -> int:
        log = tmp_path / "log.jsonl"
        argv = ["train", str(path), "--objective", "dpo", "--max-seq-len", "24", "--steps", "1"]
        return main([*argv, "--batch-size", str(batch), "--no-cache", "--log", str(log), *SMALL, *flags])

    assert train(batch=n) == 1  # the default, split: refused by name, with the two flags that take it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(rf"sftpack train: preference pair '{re.escape(str(path))}:[67]'", err[0]), err
    assert "never split" in err[0] and "--overlong truncate" in err[0] and "--overlong drop" in err[0]

    assert train("--overlong", "drop", batch=n) == 0
    out = capsys.readouterr().out
    assert f"7 conversations -> {2 * n} samples (0 split, 2 dropped)" in out
    assert json.loads((tmp_path / "log.jsonl").read_text())["pairs"] == n  # every pair left, none half

    assert train("--overlong", "truncate", batch=n + 1) == 0
    out = capsys.readouterr().out
    assert f"7 conversations -> {2 * (n + 1)} samples (0 split, 1 truncated, 1 dropped)" in out
    assert json.loads((tmp_path / "log.jsonl").read_text())["pairs"] == n + 1


def _over(chat, limit: int) -> int:
    """How many of the chat fixture's conversations are longer than ``limit`` tokens."""
    samples = tokenize_conversations(read_conversations([str(chat / "chat.jsonl")]), tiny_chat_tokenizer("chatml"))
    return sum(len(s) > limit for s in samples.to_list())


def test_sft_overlong_drop_drops_and_keys_its_own_cache_entry(chat, tmp_path, capsys) -> None:
    limit, cache = 64, tmp_path / "cache"
    over = _over(chat, limit)
    assert 0 < over < 40

    def train(*flags: str) -> str:
        argv = ["train", str(chat / "chat.jsonl"), "--tokenizer", str(chat / "tok"), "--max-seq-len", str(limit)]
        argv += ["--steps", "1", "--batch-size", "4", "--cache-dir", str(cache), *SMALL, *flags]
        assert main(argv) == 0
        return capsys.readouterr().out

    out = train()  # the default: every over-long conversation split, every token kept
    assert f"40 conversations -> {40 + over} samples ({over} split, 0 dropped)" in out and "; cached in " in out
    out = train("--overlong", "drop")  # its own entry: not the split run's samples
    assert f"40 conversations -> {40 - over} samples (0 split, {over} dropped)" in out and "; cached in " in out
    assert len(list((cache / "tokenized").iterdir())) == 2
    out = train("--overlong", "drop")
    assert f"40 conversations -> {40 - over} samples (0 split, {over} dropped)" in out
    assert "; read from the cache (" in out
    out = train("--overlong", "truncate")  # each over-long conversation's head
    assert f"40 conversations -> 40 samples (0 split, {over} truncated, 0 dropped)" in out and "; cached in " in out
    # the eval set (--eval-file, --eval-fraction) is tokenized by the same rule
    settings = {"tokenizer": str(chat / "tok"), "max_seq_len": limit, "no_cache": True}
    convs = list(read_conversations([str(chat / "chat.jsonl")]))
    for overlong, samples in (("drop", 40 - over), ("split", 40 + over)):
        run = RunConfig.from_settings({**settings, "overlong": overlong}).build()
        assert len(run.data.tokenize(convs)) == samples


def test_a_default_runs_cache_key_is_the_key_of_before(chat) -> None:
    tok = tiny_chat_tokenizer("chatml")
    convs = list(read_conversations([str(chat / "chat.jsonl")]))

    def key(**overlong: str) -> str:
        return start_training_samples(tok, convs, max_seq_len=64, cache_dir=chat / "unused", **overlong).key

    before = {  # the options start_training_samples hashed before --overlong reached it
        "max_seq_len": 64,
        "overlong": "split",
        "train_on": "all_assistant",
        "on_bad_row": "error",
        "special_tokens_in_content": "text",
    }
    assert key() == key(overlong="split") == cache_key(tokenizer_identity(tok), before, source_identity(convs))
    assert len({key(), key(overlong="drop"), key(overlong="truncate"), key(overlong="error")}) == 4


def test_overlong_is_refused_where_the_run_does_not_tokenize_text(chat, tmp_path, capsys) -> None:
    assert main(["train", "--corpus", "vqa", "--overlong", "drop", "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "sftpack train: --overlong drop: data with images is split at text boundaries (never inside an image) for "
        "now; leave --overlong out"
    ]
    rows = tmp_path / "rows"
    prepack = ["prepack", str(chat / "chat.jsonl"), "--tokenizer", str(chat / "tok"), "--max-seq-len", "256"]
    assert main([*prepack, "--out", str(rows), "--no-progress"]) == 0
    capsys.readouterr()
    argv = ["train", "--packing", "offline", "--prepacked", str(rows), "--overlong", "truncate", "--steps", "1"]
    assert main([*argv, "--tokenizer", str(chat / "tok")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "sftpack train: --overlong truncate: a --prepacked folder's conversations were tokenized by sftpack prepack: "
        "give --overlong to sftpack prepack, or train on the INPUT files"
    ]
