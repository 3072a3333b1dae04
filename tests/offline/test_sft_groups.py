"""The offline prepack with SFT groups (issue 42 item 2): the N completions of one prompt
(``meta["group"]`` without a role, each with its own advantage) are one unit of the planner, so
each group lands whole in one row, and each row is exactly its members' (ids, labels and weights
compared exactly); without the groups the same samples are packed as independent conversations."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack import PackedBatch, Sample
from sftpack.offline import PrepackedDataset, PrepackError, prepack_samples


def completions(n_groups: int = 16, *, seed: int = 2) -> list[Sample]:
    """``n_groups`` prompts' 2-5 completions each, a signed advantage on most, every 5th conversation
    of no group; a group's members not always consecutive (the planner keys on the group)."""
    rng = np.random.default_rng(seed)
    out, k = [], 0
    for g in range(n_groups):
        prompt = rng.integers(1, 400, int(rng.integers(2, 8)))
        for _ in range(int(rng.integers(2, 6))):
            answer = rng.integers(1, 400, int(rng.integers(1, 8)))
            ids = np.concatenate([prompt, answer])
            mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(answer), bool)]
            w = None if k % 4 == 0 else float(rng.uniform(-2, 2))
            out.append(Sample(ids, mask, f"c{k}", {"group": f"q{g}"}, weights=w))
            k += 1
        if g % 5 == 2:
            out.append(Sample(rng.integers(1, 400, 7), np.ones(7, bool), f"c{k}"))
            k += 1
    out[3], out[9] = out[9], out[3]  # two groups interleaved
    return out


def test_each_group_whole_in_one_row(tmp_path):
    data = completions()
    by_id = {s.conversation_id: s for s in data}
    members: dict[str, set[str]] = {}
    for s in data:
        if "group" in s.meta:
            members.setdefault(s.meta["group"], set()).add(s.conversation_id)
    ds = PrepackedDataset(prepack_samples(data, tmp_path / "g", max_seq_len=64, pad_multiple=2).path, verify="full")
    seen = []
    for r in range(ds.num_rows):
        row = ds.row(r)
        ids = set(row.sequence_ids)
        for convs in members.values():
            assert not (convs & ids) or convs <= ids
        want = PackedBatch.from_samples([by_id[c] for c in row.sequence_ids], max_seq_len=64, pad_multiple=2)
        assert np.array_equal(row.input_ids.numpy(), want.input_ids.numpy())
        assert np.array_equal(row.labels.numpy(), want.labels.numpy())
        assert (row.weights is None) == (want.weights is None)
        if want.weights is not None:
            assert np.array_equal(row.weights.numpy(), want.weights.to(row.weights.dtype).numpy())
        seen += row.sequence_ids
    assert sorted(seen) == sorted(by_id)
    # negative control: the same samples without their groups, packed as independent conversations
    plain = [Sample(s.input_ids, s.loss_mask, s.conversation_id, weights=s.weights) for s in data]
    ps = PrepackedDataset(prepack_samples(plain, tmp_path / "p", max_seq_len=64, pad_multiple=2).path)
    rows = [set(ps.row(r).sequence_ids) for r in range(ps.num_rows)]
    assert any(0 < len(convs & row) < len(convs) for convs in members.values() for row in rows)


def test_a_group_over_a_row_is_refused(tmp_path):
    big = [Sample(np.arange(1, 21), np.ones(20, bool), f"c{i}", {"group": "q"}) for i in range(3)]
    with pytest.raises(PrepackError, match=r"raise max_seq_len .*an SFT group, a prompt's completions, likewise"):
        prepack_samples(big, tmp_path / "d", max_seq_len=32)
    assert not (tmp_path / "d").exists()
