"""The loader with SFT groups (issue 42 item 2): the N completions of one prompt (``meta["group"]``,
no role, each with its own advantage) are one unit of ``PackingDataset(groups=True)``, as a
preference pair is: every group whole in one row, on every share, each row exactly its members'
(weights copied, compared with ``torch.equal``); a group out of its run is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sftpack import PackedBatch, Sample
from sftpack.loader import PackingDataset


def completions(n_groups: int, *, seed: int = 0) -> list[Sample]:
    """``n_groups`` prompts' 2-5 completions each (consecutive), a signed advantage on most, every
    7th conversation of no group."""
    rng = np.random.default_rng(seed)
    out, k = [], 0
    for g in range(n_groups):
        prompt = rng.integers(1, 90, int(rng.integers(2, 6)))
        for _ in range(int(rng.integers(2, 6))):
            answer = rng.integers(1, 90, int(rng.integers(1, 6)))
            ids = np.concatenate([prompt, answer])
            mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(answer), bool)]
            adv = None if k % 3 == 0 else float(rng.uniform(-2, 2))
            out.append(
                Sample(ids, mask, f"c{k}", {"group": g}, weights=None if adv is None else np.full(len(ids), adv))
            )
            k += 1
        if g % 7 == 3:
            out.append(Sample(rng.integers(1, 90, 9), np.ones(9, bool), f"c{k}"))
            k += 1
    return out


def make(samples, **kw) -> PackingDataset:
    opts = {"max_seq_len": 64, "buffer_size": 12, "pad_multiple": 2, "shuffle": True, "groups": True, "seed": 1}
    return PackingDataset(samples, **{**opts, **kw})


@pytest.mark.parametrize("world", [1, 2])
def test_each_group_whole_in_one_row(world) -> None:
    data = completions(24)
    by_id = {s.conversation_id: s for s in data}
    members: dict[int, set[str]] = {}
    for s in data:
        if "group" in s.meta:
            members.setdefault(s.meta["group"], set()).add(s.conversation_id)
    seen: list[str] = []
    for rank in range(world):
        for row in make(data, rank=rank, world_size=world):
            ids = set(row.sequence_ids)
            for convs in members.values():  # a group in the row is whole in it
                assert not (convs & ids) or convs <= ids
            want = PackedBatch.from_samples([by_id[c] for c in row.sequence_ids], pad_multiple=2, max_seq_len=64)
            for f in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(getattr(row, f), getattr(want, f)), f
            assert (row.weights is None) == (want.weights is None)
            if want.weights is not None:
                assert torch.equal(row.weights, want.weights)
            seen += row.sequence_ids
    assert sorted(seen) == sorted(by_id)  # every conversation once, over the shares
    # negative control: without groups=True the members are packed as independent conversations
    split = [
        row
        for row in make(data, groups=False, buffer_size=4)
        for convs in members.values()
        if 0 < len(convs & set(row.sequence_ids)) < len(convs)
    ]
    assert split, "no group split without groups=True: the test would not see a split"


def test_a_group_out_of_its_run_is_refused() -> None:
    data = completions(6)
    moved = data[1:] + data[:1]  # c0 (group 0) after the other groups
    with pytest.raises(ValueError, match=r"group 0 comes back at sample \d+ after other samples .* consecutively"):
        list(make(moved))
