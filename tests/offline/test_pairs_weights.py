"""The prepack's two optional columns (issue 42): preference pairs kept whole, per-token weights kept.

Pairs: ``sftpack prepack`` of TRL string preference rows (``prompt`` / ``chosen`` / ``rejected``,
built from the embedded corpus: each conversation's first question and answer, the rejected answer
another conversation's) writes rows in which every pair's two sequences share one row, each read
back with its id ``(group, role)`` (``sftpack.sample.pair_sequence_id``), its tokens and mask those
the tokenizer gave; ``objectives.pairs_of`` reads every row. Control: the same lengths planned
without the groups split some pair over two rows (so the check above can fail).

Weights: samples with weights (per sample, per token, negative, zero) and without, prepacked and
read back: the stored column equals each sample's weights exactly, every row's label-aligned
``weights`` equals ``PackedBatch.from_samples`` of its samples exactly (one row and the batched
read); a prepack of the same samples without weights is byte for byte the SFT prepack (no new file,
format version 2). Exact comparisons: the weights are copied, never computed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftpack import PackedBatch, Sample
from sftpack.chat import read_conversations, tokenize_conversations
from sftpack.cli import main
from sftpack.data import default_corpus
from sftpack.objectives import pairs_of
from sftpack.offline import PrepackedDataset, PrepackError, prepack_samples
from sftpack.offline._format import FILES, ROLES_FILE, WEIGHTS_FILE
from sftpack.offline._plan import plan_rows
from sftpack.sample import pair_meta, pair_sequence_id

WIDTH = 256


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """A JSONL of 30 string preference rows from the embedded corpus."""
    convs = [c.messages for c in default_corpus(limit=31)]
    rows = [
        {"prompt": m[0]["content"], "chosen": " " + m[1]["content"], "rejected": " " + convs[i + 1][1]["content"]}
        for i, m in enumerate(convs[:30])
    ]
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_sftpack_prepack_keeps_every_pair_in_one_row(prefs, tok, tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    out = tmp_path / "pairs"
    args = ["prepack", str(prefs), "--out", str(out), "--tokenizer", str(tok_dir), "--max-seq-len", str(WIDTH)]
    assert main([*args, "--overlong", "drop", "--no-progress"]) == 0
    capsys.readouterr()
    samples = tokenize_conversations(list(read_conversations([str(prefs)])), tok, max_seq_len=WIDTH, overlong="drop")
    tokenized = samples.to_list()
    # a pair whose two sequences fit the row each but not together is dropped whole (--overlong drop)
    total = {g: sum(len(s) for s in tokenized if s.meta["group"] == g) for g in {s.meta["group"] for s in tokenized}}
    samples = [s for s in tokenized if total[s.meta["group"]] <= WIDTH]
    by_id = {pair_sequence_id(s): s for s in samples}
    assert len(by_id) == len(samples) >= 40 and len(samples) < len(tokenized)  # some pairs dropped, most kept

    ds = PrepackedDataset(out, verify="full")
    m = ds.manifest
    assert m["format_version"] == 5 and m["pairs"] == {"roles": ["chosen", "rejected"], "pairs": len(samples) // 2}
    assert m["fingerprint"]["columns"] == ["pairs"] and (out / ROLES_FILE).is_file()
    assert not (out / WEIGHTS_FILE).exists()
    c = m["counts"]
    assert c["packed_conversations"] == len(samples) // 2 and c["sequences"] == len(samples)
    assert c["overlong"]["dropped"] - samples_dropped_alone(prefs, tok) == (len(tokenized) - len(samples)) // 2
    seen = []
    for r in range(ds.num_rows):
        row = ds.row(r)
        ids = list(row.sequence_ids)
        assert all(isinstance(i, tuple) for i in ids)
        pairs = pairs_of(row, pair_meta(ids))  # refuses a half pair
        assert 2 * len(pairs.groups) == len(ids)
        for k, sid in enumerate(ids):  # the tokens and mask the tokenizer gave that (group, role)
            a, b = int(row.cu_seqlens[k]), int(row.cu_seqlens[k + 1])
            assert row.input_ids[a:b].tolist() == by_id[sid].input_ids.tolist()
        seen += ids
    assert sorted(seen, key=str) == sorted(by_id, key=str)
    batch = ds.read_rows(np.arange(ds.num_rows))
    assert list(batch.sequence_ids) == seen

    # control: the same lengths planned without the groups split pairs over rows
    order = ds.sequences["conversation"]
    lengths = ds.sequences["length"]
    plain = plan_rows(lengths, max_seq_len=WIDTH)
    row_of = np.repeat(np.arange(plain.num_rows), np.diff(plain.row_offsets))[np.argsort(plain.order)]
    split = sum(len(set(row_of[order == c].tolist())) > 1 for c in np.unique(order))
    assert split > 0
    print(
        f"{len(samples) // 2} pairs in {ds.num_rows} rows (fill {m['counts']['fill']:.1%}); ungrouped plan: "
        f"{plain.num_rows} rows, {split} pairs split"
    )


def samples_dropped_alone(prefs, tok) -> int:
    """Pairs the tokenizer drops itself (a member over the row)."""
    t = tokenize_conversations(list(read_conversations([str(prefs)])), tok, max_seq_len=WIDTH, overlong="drop")
    t.to_list()
    return int(t.stats.dropped)


def test_a_half_pair_and_a_mixed_prepack_are_refused(tok, tmp_path):
    def member(g: str, role: str, n: int = 5) -> Sample:
        return Sample(np.arange(1, n + 1), np.ones(n, bool), g, {"group": g, "role": role, "group_size": 2})

    with pytest.raises(ValueError, match=r"pair 'p' .* has 1 of its 2 samples \(chosen\): a pair is packed whole"):
        prepack_samples(
            [member("p", "chosen"), member("q", "chosen"), member("q", "rejected")], tmp_path / "a", max_seq_len=32
        )
    plain = Sample(np.arange(1, 4), np.ones(3, bool), "s")
    with pytest.raises(ValueError, match=r"sample 2 \(conversation 's'\) is an SFT conversation, but the samples"):
        prepack_samples([member("p", "chosen"), member("p", "rejected"), plain], tmp_path / "b", max_seq_len=32)
    with pytest.raises(ValueError, match="pair 'p' comes back after other samples"):
        again = [member("p", "chosen"), member("p", "rejected"), member("q", "chosen"), member("q", "rejected")]
        prepack_samples([*again, member("p", "chosen")], tmp_path / "c", max_seq_len=32)
    with pytest.raises(PrepackError, match="a preference pair is packed whole in one row: raise max_seq_len"):
        prepack_samples([member("p", "chosen", 20), member("p", "rejected", 20)], tmp_path / "d", max_seq_len=32)
    assert not any((tmp_path / x).exists() for x in "abcd")


def _weighted(n: int = 24) -> list[Sample]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        k = int(rng.integers(3, 40))
        mask = rng.random(k) < 0.7
        w: object = [None, 2.5, 0.0, -0.75, rng.normal(size=k), rng.normal(size=k).astype(np.float32)][i % 6]
        out.append(Sample(rng.integers(1, 500, size=k), mask, f"c{i}", weights=w))
    return out


def test_weights_survive_the_prepack_exactly(tmp_path):
    samples = _weighted()
    ds = PrepackedDataset(prepack_samples(samples, tmp_path / "w", max_seq_len=64, pad_multiple=4).path, verify="full")
    assert ds.manifest["format_version"] == 5 and ds.manifest["weights"] == {"dtype": "float64"}
    by_id = {s.conversation_id: s for s in samples}
    assert ds.weights is not None
    for seq in ds.sequences:  # the stored column: each sample's weights, 1 where it had none
        s = by_id[ds.conversation_id(int(seq["conversation"]))]
        want = np.ones(len(s)) if s.weights is None else np.asarray(s.weights, np.float64)
        assert np.array_equal(ds.weights[seq["start"] : seq["start"] + seq["length"]], want)
    rows = []
    for r in range(ds.num_rows):
        row = ds.row(r)
        ref = PackedBatch.from_samples([by_id[c] for c in row.sequence_ids], max_seq_len=64, pad_multiple=4)
        assert ref.weights is not None and row.weights is not None
        assert np.array_equal(row.weights.numpy(), ref.weights.to(row.weights.dtype).numpy())
        assert np.array_equal(row.labels.numpy(), ref.labels.numpy())
        rows.append(row)
    both = ds.read_rows(np.arange(ds.num_rows)[::-1])
    assert both.weights is not None
    assert np.array_equal(both.weights.numpy(), PackedBatch.concat(rows[::-1]).weights.numpy())  # type: ignore[union-attr]
    cut = ds.__getitems__([0, 1])
    assert np.array_equal(cut[1].weights.numpy(), ds[1].weights.numpy())  # type: ignore[union-attr]

    # control: the same samples without weights write the SFT prepack, byte for byte, and no column
    plain = [Sample(s.input_ids, s.loss_mask, s.conversation_id) for s in samples]
    a = prepack_samples(plain, tmp_path / "plain", max_seq_len=64, pad_multiple=4)
    assert (
        a.manifest["format_version"] == 2 and "weights" not in a.manifest and "columns" not in a.manifest["fingerprint"]
    )
    assert sorted(p.name for p in a.path.iterdir()) == sorted([*FILES, "manifest.json"])
    for name in FILES:
        assert (a.path / name).read_bytes() == (ds.path / name).read_bytes()
    assert PrepackedDataset(a.path).row(0).weights is None
