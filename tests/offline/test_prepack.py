"""sftpack.offline.prepack: rows, accounting, determinism, the format on disk."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from sftpack.chat import read_conversations, tokenize_conversations
from sftpack.handoff import padded_lengths
from sftpack.offline import PrepackedDataset, prepack, prepack_samples
from sftpack.offline._format import FILES
from sftpack.offline.engine import plan_rows
from sftpack.testing import samples_from_lengths

from .conftest import BAD_ROWS, MAX_SEQ_LEN, N_GOOD


def _dir_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _reference_samples(chat_file, tok, **opts):
    reader = read_conversations(chat_file, on_bad_row="skip")
    return tokenize_conversations(reader, tok, max_seq_len=MAX_SEQ_LEN, overlong="split", **opts).to_list()


def test_every_row_validates_and_the_multiset_of_sequences_is_the_corpus(built, chat_file, tok):
    result, out = built
    ds = PrepackedDataset(out, verify="full")
    seen = Counter()
    for i in range(len(ds)):
        row = ds[i].validate()
        assert row.num_tokens == MAX_SEQ_LEN
        padded = row.padded_seqlens.tolist()
        assert all(p % 4 == 0 for p in padded)  # pad multiple 4, the tail folded into the last segment too
        starts, lens = row.cu_seqlens_padded.tolist(), row.seqlens.tolist()
        labels = row.labels
        for cid, s, n in zip(row.sequence_ids, starts, lens):
            ids = tuple(row.input_ids[s : s + n].tolist())
            seen[(cid, ids, int((labels[s : s + n] != -100).sum()))] += 1
    expected = Counter(
        (s.conversation_id, tuple(s.input_ids.tolist()), int(s.loss_mask[1:].sum()))
        for s in _reference_samples(chat_file, tok)
    )
    assert seen == expected
    c = result.counts
    assert c["sequences"] == sum(expected.values())
    assert c["labels"] == sum(k[2] * v for k, v in expected.items())


def test_counts_satisfy_the_accounting_identities(built):
    c = built[0].counts
    assert c["read"] == N_GOOD + len(BAD_ROWS)
    assert c["dropped"] == {reason: 1 for _, reason in BAD_ROWS}
    assert c["read"] == c["kept"] + sum(c["dropped"].values())
    oc = c["overlong"]
    assert oc["split"] > 0, "the fixture should exercise the split policy"
    assert oc["tokenized"] == c["kept"] == oc["fit"] + oc["split"] + oc["truncated"] + oc["dropped"]
    assert c["tokens_rendered"] == c["tokens"] + c["tokens_lost"]
    assert c["labels"] == c["trainable_tokens"] - c["first_token_trainable"]
    assert c["slots"] == c["rows"] * MAX_SEQ_LEN == c["tokens"] + c["padding"]
    assert c["rows"] >= c["l1"]


def test_truncate_and_drop_count_their_losses(chat_file, tok, tmp_path):
    for policy in ("truncate", "drop"):
        r = prepack(chat_file, tmp_path / policy, tokenizer=tok, max_seq_len=512, overlong=policy)
        c = r.counts
        assert c["overlong"][{"truncate": "truncated", "drop": "dropped"}[policy]] > 0
        assert c["tokens_lost"] > 0
        ref = tokenize_conversations(
            read_conversations(chat_file, on_bad_row="skip"), tok, max_seq_len=512, overlong=policy
        )
        samples = ref.to_list()
        assert c["tokens"] == sum(len(s) for s in samples)
        assert c["tokens_lost"] == ref.stats.tokens_lost
        assert c["tokens_rendered"] == c["tokens"] + c["tokens_lost"]


def test_the_files_are_byte_identical_for_any_num_proc_and_on_rerun(built, chat_file, tok, tmp_path):
    _, out1 = built
    out2 = tmp_path / "p2"
    prepack(chat_file, out2, tokenizer=tok, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, overlong="split", num_proc=2)
    a, b = _dir_bytes(out1), _dir_bytes(out2)
    assert sorted(a) == sorted(FILES + ("manifest.json",))
    for name in FILES:
        assert a[name] == b[name], name
    assert a["manifest.json"] == b["manifest.json"]  # no timings or process counts in the manifest


def test_tokens_are_stored_in_the_vocabulary_dtype_without_padding(built, tok):
    _, out = built
    m = json.loads((out / "manifest.json").read_text())
    assert len(tok) == 284 and m["token_dtype"] == "uint16"
    tokens = np.load(out / "tokens.npy", mmap_mode="r")  # plain .npy: readable without sftpack
    seqs = np.load(out / "sequences.npy", mmap_mode="r")
    assert tokens.dtype == np.uint16 and tokens.shape[0] == m["counts"]["tokens"] == int(seqs["length"].sum())
    assert np.load(out / "loss_mask.npy").dtype == np.bool_
    assert m["pad_id"] == tok.pad_token_id


def test_manifest_fingerprint_records_what_the_rows_depend_on(built, chat_file, tok):
    m = json.loads((built[1] / "manifest.json").read_text())
    fp = m["fingerprint"]
    assert m["format_version"] == 2 and m["sftpack_version"]
    want = {
        "max_seq_len": MAX_SEQ_LEN,
        "pad_multiple": 4,
        "algorithm": "bfd",
        "seed": 0,
        "overlong": "split",
        "train_on": "all_assistant",
    }
    for key, value in want.items():
        assert fp[key] == value, key
    assert fp["inputs"] == [
        {
            "name": str(chat_file),
            "size": chat_file.stat().st_size,
            "sha256": __import__("hashlib").sha256(chat_file.read_bytes()).hexdigest(),
        }
    ]
    assert fp["tokenizer"]["vocab_size"] == len(tok) and len(fp["tokenizer"]["chat_template_sha256"]) == 64
    for name in FILES:
        assert m["files"][name]["bytes"] == (built[1] / name).stat().st_size


def test_the_plan_charges_the_row_builders_padding():
    lengths = np.array([5, 10, 3, 8, 6, 13, 1])
    plan = plan_rows(lengths, max_seq_len=16, pad_multiple=4)
    loads = np.add.reduceat(padded_lengths(plan.lengths, 4), plan.row_offsets[:-1])
    assert loads.max() <= 16
    assert sorted(plan.order.tolist()) == list(range(7))
    for r in range(plan.num_rows):  # input order within each row
        members = plan.order[plan.row_offsets[r] : plan.row_offsets[r + 1]]
        assert np.all(np.diff(members) > 0)


def test_prepack_samples_keeps_a_given_membership_and_self_describing_tokens(tmp_path):
    samples = samples_from_lengths([5, 10, 3, 8, 6])
    r = prepack_samples(samples, tmp_path / "p", max_seq_len=32, row_sizes=[2, 3])
    ds = PrepackedDataset(r.path)
    assert len(ds) == 2
    row = ds[1].validate()
    assert row.seqlens.tolist() == [3, 8, 6]
    assert row.input_ids[:3].tolist() == [3000, 3001, 3002]  # sample 2 holds 1000*(2+1)+arange
    assert row.cu_seqlens_padded.tolist() == [0, 3, 11, 32]


def test_nothing_to_pack_is_an_error_and_leaves_nothing(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="nothing to pack"):
        prepack(path, tmp_path / "out", tokenizer=tok, max_seq_len=64)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_options_are_checked_before_anything_is_read(tmp_path, chat_file, tok):
    with pytest.raises(ValueError, match="not a multiple of pad_multiple"):
        prepack(chat_file, tmp_path / "o", tokenizer=tok, max_seq_len=1000, pad_multiple=16)
    with pytest.raises(ValueError, match="engine='spark' is not valid: choose one of 'local'"):
        prepack(chat_file, tmp_path / "o", tokenizer=tok, engine="spark")
    with pytest.raises(ValueError, match="algorithm='best' is not valid"):
        prepack(chat_file, tmp_path / "o", tokenizer=tok, algorithm="best")
    assert not (tmp_path / "o").exists()


def test_a_lone_later_piece_keeps_its_own_conversation_id(tmp_path):
    """A piece of a split conversation whose earlier pieces were filtered out starts its
    own conversation: its segment is labelled with its id, never the previous sample's."""
    from sftpack import Sample

    a = Sample(np.arange(1, 6), np.ones(5, bool), "conv-a")
    b_piece1 = Sample(np.arange(101, 111), np.ones(10, bool), "conv-b", meta={"piece": 1})
    c0 = Sample(np.arange(201, 204), np.ones(3, bool), "conv-c", meta={"piece": 0})
    c1 = Sample(np.arange(301, 305), np.ones(4, bool), "conv-c", meta={"piece": 1})
    out = prepack_samples([a, b_piece1, c0, c1], tmp_path / "p", max_seq_len=32).path
    ds = PrepackedDataset(out, verify="full")
    held = {}
    for i in range(len(ds)):
        row = ds[i]
        for cid, ids in zip(row.sequence_ids, row.input_ids.split(row.padded_seqlens.tolist())):
            held.setdefault(cid, []).append(int(ids[0]))
    assert held["conv-a"] == [1]
    assert held["conv-b"] == [101]  # before the fix: labelled "conv-a"
    assert sorted(held["conv-c"]) == [201, 301]
