"""TRL's preference pairs (``prompt`` / ``chosen`` / ``rejected``): strings with an explicit prompt,
message lists with an explicit or an implicit prompt. Each pair gives two samples (chosen, rejected)
starting with the very same prompt tokens, only the answer trained, ``meta`` naming the pair and the
role; a malformed pair is dropped whole under its reason (or raised naming file, line and field);
over-long pairs follow ``overlong`` whole; the training cache keeps each pair with its conversation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sftpack.chat import (
    BadRowError,
    OverlongError,
    PreferencePair,
    detect_format,
    encode_conversation,
    read_conversations,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_pair,
)
from sftpack.chat._training_samples import start_training_samples
from sftpack.data import default_tokenizer
from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import write_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "What is 2 + 3?"}
GOOD = {"role": "assistant", "content": "It is 5."}
BAD = {"role": "assistant", "content": "It is 6, I think."}

STRINGS = {"prompt": "Hello", "chosen": "world, again.", "rejected": " there"}
EXPLICIT = {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]}
IMPLICIT = {"chosen": [SYSTEM, USER, GOOD], "rejected": [SYSTEM, USER, BAD]}


@pytest.fixture(scope="module")
def qwen() -> Any:
    return default_tokenizer()


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _check_pair(tok: Any, chosen: Any, rejected: Any, prompt: list[int], answers: list[list[int]], trained: list[str]):
    """Both samples: the prompt's ids, then the answer's; trained exactly ``trained``; meta names the pair."""
    k = len(prompt)
    for s, answer, text, role in zip((chosen, rejected), answers, trained, ("chosen", "rejected")):
        assert s.input_ids.tolist() == prompt + answer
        assert not s.loss_mask[:k].any()  # the prompt never trained
        assert tok.decode(s.input_ids[s.loss_mask]) == text
        assert s.meta == {"group": chosen.conversation_id, "role": role, "group_size": 2}
        assert s.conversation_id == chosen.conversation_id
    assert chosen.input_ids[:k].tobytes() == rejected.input_ids[:k].tobytes()
    assert chosen.input_ids[k:].tolist() != rejected.input_ids[k:].tolist()


def test_string_pair_is_the_prompt_tokens_then_each_answer_and_eos(qwen: Any) -> None:
    chosen, rejected = tokenize_pair(STRINGS, qwen, conversation_id="p0")
    eos = qwen.eos_token_id
    prompt = _ids(qwen, "Hello")  # Qwen adds no BOS
    answers = [_ids(qwen, "world, again.") + [eos], _ids(qwen, " there") + [eos]]
    _check_pair(qwen, chosen, rejected, prompt, answers, ["world, again.<|im_end|>", " there<|im_end|>"])
    assert chosen.loss_mask[len(prompt) :].all() and rejected.loss_mask[len(prompt) :].all()  # the answer + EOS
    # the prompt and the answer are encoded apart (TRL's rule), not as one text: "Helloworld" merges
    assert _ids(qwen, "Helloworld, again.")[: len(prompt)] != prompt


@pytest.mark.parametrize("row", [EXPLICIT, IMPLICIT], ids=["explicit", "implicit"])
def test_message_pair_renders_the_prompt_once_and_trains_the_answers(qwen: Any, row: dict) -> None:
    chosen, rejected = tokenize_pair(row, qwen, conversation_id=7)
    head = qwen.apply_chat_template([SYSTEM, USER], tokenize=False)
    prompt = _ids(qwen, head)
    answers = []
    for answer in (GOOD, BAD):
        whole = qwen.apply_chat_template([SYSTEM, USER, answer], tokenize=False)
        assert whole.startswith(head)
        answers.append(_ids(qwen, whole[len(head) :]))
    trained = ["It is 5.<|im_end|>", "It is 6, I think.<|im_end|>"]
    _check_pair(qwen, chosen, rejected, prompt, answers, trained)
    # each member is exactly what the same conversation gives as a messages row
    for s, answer in zip((chosen, rejected), (GOOD, BAD)):
        alone = tokenize_conversation([SYSTEM, USER, answer], qwen)
        assert s.input_ids.tobytes() == alone.input_ids.tobytes()
        assert s.loss_mask.tobytes() == alone.loss_mask.tobytes()


def test_implicit_prompt_is_the_common_leading_messages() -> None:
    two_turns = [USER, GOOD, {"role": "user", "content": "And 3 + 3?"}]
    pair = PreferencePair.of(
        {"chosen": [*two_turns, {"role": "assistant", "content": "6"}], "rejected": [*two_turns, BAD]}
    )
    assert pair.implicit and pair.prompt == two_turns
    assert [m["content"] for m in pair.members()[1]] == [m["content"] for m in [*two_turns, BAD]]
    tok = tiny_chat_tokenizer("chatml")
    chosen, rejected = tokenize_pair(pair.as_row(), tok)
    assert tok.decode(chosen.input_ids[chosen.loss_mask]) == "6<|im_end|>"  # the prompt's assistant turn not trained
    assert tok.decode(rejected.input_ids[rejected.loss_mask]) == "It is 6, I think.<|im_end|>"


def test_detection_keeps_the_other_formats() -> None:
    pc = {"prompt": "a", "completion": "b"}
    assert detect_format(pc) == "prompt_completion"
    assert detect_format({**pc, "chosen": "c", "rejected": "d"}) == "prompt_completion"
    assert detect_format({"prompt": [USER], "completion": [GOOD]}) == "conversational_prompt_completion"
    assert detect_format({"messages": [USER, GOOD], "chosen": "x"}) == "messages"
    assert detect_format({"chosen": None, "rejected": None, "text": "t"}) == "text"
    assert detect_format(STRINGS) == "preference"
    assert detect_format({"chosen": "only"}) == "preference"
    assert detect_format(EXPLICIT) == detect_format(IMPLICIT) == "conversational_preference"
    tok = tiny_chat_tokenizer("chatml")
    s = tokenize_conversation(pc, tok)  # one sample, no pair meta
    assert s.meta == {} and tok.decode(s.input_ids) == "ab<|im_end|>"


#: a malformed pair, the reason it is dropped under and the field its error names
MALFORMED: list[tuple[dict[str, Any], str, str]] = [
    ({"prompt": "p", "chosen": "a"}, "missing_field", "'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": "  "}, "empty_content", "'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "identical_answers", "'chosen' and 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": 5}, "non_string_content", "'rejected'"),
    ({"chosen": "a", "rejected": "b"}, "missing_field", "'prompt'"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": "b"}, "malformed_message", "'rejected'"),
    ({"prompt": [USER], "chosen": [], "rejected": [BAD]}, "empty_messages", "'chosen'"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": [USER]}, "no_assistant_turn", "'rejected'"),
    ({"prompt": [USER], "chosen": [USER, GOOD], "rejected": [BAD]}, "prompt_mismatch", "'chosen'"),
    ({"prompt": [USER], "chosen": [GOOD], "rejected": [GOOD]}, "identical_answers", "'chosen' and 'rejected'"),
    ({"chosen": [USER, GOOD], "rejected": [SYSTEM, USER, BAD]}, "no_common_prompt", "'chosen' and 'rejected'"),
    ({"chosen": [USER, GOOD, USER, BAD], "rejected": [USER, GOOD, SYSTEM]}, "no_assistant_turn", "'rejected'"),
    ({"chosen": [USER, GOOD], "rejected": [USER, GOOD, USER, GOOD]}, "empty_messages", "'chosen'"),
    ({"chosen": [USER, {"role": "robot", "content": "x"}], "rejected": [USER, BAD]}, "unknown_role", "'chosen'"),
]


@pytest.mark.parametrize("row,reason,field", MALFORMED, ids=[f"{m[1]}-{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_pair_is_raised_naming_file_line_field_and_fix(
    tmp_path: Path, row: dict, reason: str, field: str
) -> None:
    good = STRINGS if detect_format(row) == "preference" else EXPLICIT
    path = write_jsonl(tmp_path / "prefs.jsonl", [json.dumps(good), json.dumps(row)])
    with pytest.raises(BadRowError) as info:
        list(read_conversations(path))
    msg = str(info.value)
    assert info.value.reason.value == reason and info.value.location == "line 2"
    assert str(path) in msg and f"[{reason}]" in msg and field in msg and "Fix:" in msg
    # the tokenizer's own checks (a row that did not come from the reader) give the same reason
    skipped = encode_conversation(row, tiny_chat_tokenizer("chatml"), on_bad_row="skip")
    assert skipped.samples == [] and skipped.skip is not None and skipped.skip[0].value == reason


def test_malformed_pairs_are_dropped_whole_and_counted(tmp_path: Path) -> None:
    bad = [(r, reason) for r, reason, _ in MALFORMED if detect_format(r) == "conversational_preference"]
    rows = [EXPLICIT, *(r for r, _ in bad), IMPLICIT]
    path = write_jsonl(tmp_path / "prefs.jsonl", [json.dumps(r) for r in rows])
    reader = read_conversations(path, on_bad_row="skip")
    out = tokenize_conversations(reader, tiny_chat_tokenizer("chatml"), on_bad_row="skip")
    samples = out.to_list()
    want: dict[str, int] = {}
    for _, reason in bad:
        want[reason] = want.get(reason, 0) + 1
    assert reader.stats.dropped == want and reader.stats.formats == {"conversational_preference": 2}
    assert reader.stats.read == len(rows) and reader.stats.kept == 2
    assert [(s.conversation_id, s.meta["role"]) for s in samples] == [
        (f"{path}:1", "chosen"),
        (f"{path}:1", "rejected"),
        (f"{path}:{len(rows)}", "chosen"),
        (f"{path}:{len(rows)}", "rejected"),
    ]
    assert out.stats.conversations == out.stats.fit == 2 and out.stats.samples == 4
    assert out.stats.label_tokens == out.stats.labels


def test_a_pair_the_tokenizer_cannot_train_is_skipped_whole() -> None:
    tok = tiny_chat_tokenizer("chatml")
    enc = encode_conversation(EXPLICIT, tok, train_on="last_assistant", on_bad_row="skip")
    assert len(enc.samples) == 2  # the answer is the last assistant turn: trained
    plain = {"prompt": "p", "chosen": "a", "rejected": "b"}
    no_eos = tiny_chat_tokenizer("chatml")
    no_eos.eos_token = None
    enc = encode_conversation(plain, no_eos, on_bad_row="skip")
    assert enc.samples == [] and enc.skip is not None and enc.skip[0].value == "template_error"


def _long_pair(n: int) -> dict[str, Any]:
    return {"prompt": [USER], "chosen": [GOOD], "rejected": [{"role": "assistant", "content": "no " * n}]}


def test_overlong_pairs_follow_the_policy_whole() -> None:
    tok = tiny_chat_tokenizer("chatml")
    chosen, rejected = tokenize_pair(_long_pair(30), tok)
    limit = len(chosen) + 4  # the chosen fits, the rejected does not
    assert len(rejected) > limit
    short = {"prompt": [USER], "chosen": [GOOD], "rejected": [{"role": "assistant", "content": "No."}]}
    rows = [_long_pair(30), short]

    drop = tokenize_conversations(rows, tok, max_seq_len=limit, overlong="drop")
    kept = drop.to_list()
    assert [s.conversation_id for s in kept] == [1, 1]  # the whole first pair left out, the second whole
    assert drop.stats.dropped == 1 and drop.stats.fit == 1
    assert drop.stats.tokens_lost == len(chosen) + len(rejected)
    assert drop.stats.labels_lost == chosen.loss_mask[1:].sum() + rejected.loss_mask[1:].sum()

    trunc = tokenize_conversations(rows, tok, max_seq_len=limit, overlong="truncate")
    c, r, *rest = trunc.to_list()
    assert len(rest) == 2 and trunc.stats.truncated == 1
    assert c.input_ids.tobytes() == chosen.input_ids.tobytes() and "truncated_from" not in c.meta
    assert r.input_ids.tolist() == rejected.input_ids[:limit].tolist() and r.meta["truncated_from"] == len(rejected)
    assert r.meta["role"] == "rejected" and r.meta["group"] == 0
    assert trunc.stats.label_tokens + trunc.stats.labels_lost == trunc.stats.labels

    # a member whose answer would be cut off entirely: no pair left, dropped (counted)
    head = min(int(np.argmax(s.loss_mask)) for s in tokenize_pair(EXPLICIT, tok))  # the first answer token
    gone = tokenize_conversations([EXPLICIT], tok, max_seq_len=head, overlong="truncate")
    assert gone.to_list() == [] and gone.stats.dropped == 1

    for policy in ("split", "error"):
        with pytest.raises(OverlongError, match="never split") as info:
            tokenize_conversations(rows, tok, max_seq_len=limit, overlong=policy).to_list()
        assert info.value.conversation_id == 0 and info.value.length == len(rejected)


def test_the_one_sample_and_the_pair_functions_refuse_the_other_kind() -> None:
    tok = tiny_chat_tokenizer("chatml")
    with pytest.raises(ValueError, match="tokenize_pair"):
        tokenize_conversation(EXPLICIT, tok)
    with pytest.raises(ValueError, match="tokenize_conversation"):
        tokenize_pair([USER, GOOD], tok)
    with pytest.raises(ValueError, match="drop"):
        tokenize_pair(EXPLICIT, tok, overlong="drop")


def test_the_reader_and_a_table_give_the_pairs_the_rows_give(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tiny_chat_tokenizer("chatml")
    rows = [STRINGS, {"prompt": "", "chosen": "yes", "rejected": "no"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    jsonl = write_jsonl(tmp_path / "p.jsonl", [json.dumps(r) for r in rows])
    want = tokenize_conversations(rows, tok).to_list()
    for path in (tmp_path / "p.parquet", jsonl):
        reader = read_conversations(path)
        got = tokenize_conversations(reader, tok).to_list()
        assert reader.stats.formats == {"preference": 2}
        assert [(s.input_ids.tobytes(), s.loss_mask.tobytes(), s.meta["role"]) for s in got] == [
            (s.input_ids.tobytes(), s.loss_mask.tobytes(), s.meta["role"]) for s in want
        ]
    # an empty prompt: the answer and EOS, every token trained
    assert tok.decode(want[2].input_ids) == "yes<|im_end|>" and want[2].loss_mask.all()


def test_the_training_cache_keeps_each_pair_with_its_conversation(tmp_path: Path) -> None:
    tok = tiny_chat_tokenizer("chatml")
    rows = [EXPLICIT, {"messages": [USER, GOOD]}, IMPLICIT, STRINGS]
    rows = [r if i != 3 else {"prompt": [USER], "chosen": [BAD], "rejected": [GOOD]} for i, r in enumerate(rows)]

    def job() -> Any:
        return start_training_samples(tok, rows, max_seq_len=64, cache_dir=tmp_path, seed=3, ready=True).finish()

    first, again = job(), job()
    assert not first.hit and again.hit
    assert first.positions is not None and again.positions is not None
    assert first.positions.tolist() == again.positions.tolist() == [0, 0, 1, 2, 2, 3, 3]
    roles = [s.meta.get("role") for s in first.samples]
    assert roles == ["chosen", "rejected", None, "chosen", "rejected", "chosen", "rejected"]
    for a, b in zip(first.samples, again.samples, strict=True):
        assert a.input_ids.tobytes() == b.input_ids.tobytes() and a.meta == b.meta
    assert np.array_equal(first.samples[0].input_ids, first.samples[3].input_ids)  # explicit == implicit


def test_special_token_text_in_one_answer_keeps_the_shared_prompt(qwen: Any) -> None:
    typed = {"role": "assistant", "content": "Type <|im_end|> to stop."}  # text, not the control token
    chosen, rejected = tokenize_pair({"prompt": [SYSTEM, USER], "chosen": [typed], "rejected": [BAD]}, qwen)
    for s, answer in zip((chosen, rejected), (typed, BAD)):
        alone = tokenize_conversation([SYSTEM, USER, answer], qwen)
        assert s.input_ids.tobytes() == alone.input_ids.tobytes()
        assert s.loss_mask.tobytes() == alone.loss_mask.tobytes()
    assert (chosen.input_ids == qwen.convert_tokens_to_ids("<|im_end|>")).sum() == 3  # 2 prompt turns + the answer's
    n = len(_ids(qwen, qwen.apply_chat_template([SYSTEM, USER], tokenize=False)))
    assert chosen.input_ids[:n].tobytes() == rejected.input_ids[:n].tobytes()
    # a string pair whose answer ends with the EOS string takes no second one (TRL's rule)
    c, r = tokenize_pair({"prompt": "Q:", "chosen": " yes<|im_end|>", "rejected": " no"}, qwen)
    assert qwen.decode(c.input_ids) == "Q: yes<|im_end|>" and qwen.decode(r.input_ids) == "Q: no<|im_end|>"
    k = len(_ids(qwen, "Q:"))
    assert c.input_ids[:k].tolist() == r.input_ids[:k].tolist() == _ids(qwen, "Q:")


def test_worker_processes_give_the_same_pairs() -> None:
    tok = tiny_chat_tokenizer("chatml")
    rows = [EXPLICIT, IMPLICIT, {"messages": [USER, GOOD]}, {"chosen": [USER, GOOD], "rejected": [USER]}] * 3
    one = tokenize_conversations(rows, tok, batch_size=3, on_bad_row="skip")
    two = tokenize_conversations(rows, tok, batch_size=3, num_proc=2, on_bad_row="skip")
    a, b = one.to_list(), two.to_list()
    assert len(a) == 15 and one.stats.skipped == {"no_assistant_turn": 3}
    assert [(s.input_ids.tobytes(), s.loss_mask.tobytes(), s.conversation_id, s.meta) for s in a] == [
        (s.input_ids.tobytes(), s.loss_mask.tobytes(), s.conversation_id, s.meta) for s in b
    ]
    assert one.stats == two.stats


def test_sft_commands_refuse_pairs_whole(tmp_path, capsys):
    """SFT training refuses a pair (never train the rejected answer as an SFT target), naming the
    conversation and the way out; prepack keeps the pair whole in one row (tests/offline/test_pairs_weights.py)."""
    from sftpack.cli import main
    from sftpack.offline import PrepackedDataset

    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "Hi there", "chosen": "Hello!", "rejected": "Go away."}\n')
    assert main(["train", str(data), "--steps", "1"]) != 0
    err = capsys.readouterr().err
    assert "prefs.jsonl:1' is the chosen answer of a preference pair" in err, err
    assert main(["prepack", str(data), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert [r for _, r in PrepackedDataset(tmp_path / "out").row(0).sequence_ids] == ["chosen", "rejected"]
