"""A sample with more vision patches than a row may hold (issue 26, item 3).

``sftpack prepack --corpus vqa --max-patches-per-row N`` on a corpus where one
conversation alone holds more than ``N`` patches: under ``--overlong drop`` or
``split`` it is dropped and counted as ``over_patch_budget`` (``read == kept +
sum(dropped)``), the same files for ``--num-proc`` 1 and 2; under ``--overlong
error`` one line names the conversation, its patches, the budget and the fix, exit
1 (a data error), and no directory is left. The loader counts or refuses the same
conversation the same way: one rule (:func:`sftpack.multimodal._plan.check_patch_budget`).
"""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack import Sample  # noqa: E402
from sftpack.cli import main  # noqa: E402
from sftpack.handoff.payload import PatchMedia  # noqa: E402
from sftpack.multimodal import vqa_corpus  # noqa: E402
from sftpack.multimodal._plan import OVER_PATCH_BUDGET, PatchBudgetError, check_patch_budget  # noqa: E402
from sftpack.offline import PrepackedDataset  # noqa: E402

#: easy-vqa, seed 0: conversations 0, 1, 2 hold 24, 768 and 88 vision patches (233 tokens for 1)
LIMIT, BUDGET, HEAVY, HEAVY_PATCHES = "3", 500, "easy-vqa:train:1", 768


def _prepack(out, *extra):
    args = ["prepack", "--corpus", "vqa", "--seed", "0", "--limit", LIMIT, "--out", str(out), "--no-progress"]
    return main([*args, "--max-patches-per-row", str(BUDGET), *extra])


def _ids(ds):
    return sorted({c for r in range(len(ds)) for c in ds[r].sequence_ids})


@pytest.mark.parametrize("overlong", ["drop", "split"])
def test_a_sample_over_the_patch_budget_is_dropped_and_counted(tmp_path, capsys, overlong):
    # --max-seq-len 200 under split: the heavy conversation (233 tokens) is cut, and its image piece is over
    width = "512" if overlong == "drop" else "200"
    out = tmp_path / "p1"
    assert _prepack(out, "--overlong", overlong, "--max-seq-len", width, "--on-bad-row", "skip") == 0
    text = capsys.readouterr().out
    assert re.search(rf"dropped \(by reason\)\s+{OVER_PATCH_BUDGET} 1\n", text), text
    ds = PrepackedDataset(out, verify="full")
    c = ds.manifest["counts"]
    assert c["dropped"] == {OVER_PATCH_BUDGET: 1} and c["read"] == 3 and c["kept"] == 2
    assert c["read"] == c["kept"] + sum(c["dropped"].values())
    assert c["overlong"]["split"] == 0 and c["overlong"]["dropped"] == 0
    assert _ids(ds) == ["easy-vqa:train:0", "easy-vqa:train:2"]
    assert ds.manifest["media"]["patches"] == 24 + 88
    if overlong == "drop":  # the files do not depend on the processes
        out2 = tmp_path / "p2"
        assert _prepack(out2, "--overlong", overlong, "--max-seq-len", width, "--num-proc", "2") == 0
        names = sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
        assert names == sorted(p.name for p in out2.iterdir() if p.name != "manifest.json")
        for name in names:
            assert (out / name).read_bytes() == (out2 / name).read_bytes(), name


@pytest.mark.parametrize("num_proc", ["1", "2"])
def test_over_the_patch_budget_under_overlong_error_is_a_data_error_naming_the_conversation(tmp_path, capsys, num_proc):
    out = tmp_path / "never"
    rc = _prepack(out, "--overlong", "error", "--max-seq-len", "512", "--on-bad-row", "skip", "--num-proc", num_proc)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        f"sftpack prepack: conversation {HEAVY!r} has {HEAVY_PATCHES} vision patches, more than "
        f"--max-patches-per-row {BUDGET}"
    ), err
    assert "raise --max-patches-per-row" in lines[0] and "--overlong drop" in lines[0], err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_the_loader_counts_and_refuses_the_same_conversation():
    from sftpack.loader import PackingDataset

    convs = list(vqa_corpus(seed=0, limit=int(LIMIT)))
    kw = {"max_seq_len": 512, "buffer_size": 8, "max_patches_per_row": BUDGET, "pad_id": 151643}
    ds = PackingDataset(convs, overlong="drop", **kw)
    rows = list(ds)
    assert ds.stats.dropped_by == {OVER_PATCH_BUDGET: 1} and ds.stats.samples_in == 3
    assert sorted(c for r in rows for c in r.sequence_ids) == ["easy-vqa:train:0", "easy-vqa:train:2"]
    with pytest.raises(ValueError, match=rf"conversation {HEAVY!r}\) has {HEAVY_PATCHES} vision patches, more than "):
        list(PackingDataset(convs, overlong="error", **kw))


def _sample(cid, patches):
    n = patches // 4
    ids = np.array([1, 151652] + [151655] * n + [151653])
    media = PatchMedia(
        pixel_values=np.zeros((patches, 1176), np.float32),
        slots=[(2, n)],
        sequence=[0],
        token_id=151655,
        grid_thw=[(1, 2, patches // 2)],
        merge_size=2,
    )
    return Sample(ids, ids == 1, cid, media=media)


def test_the_rule_every_path_shares():
    pieces = [_sample("c", 8), _sample("c", 16)]
    assert check_patch_budget(pieces, None, "error") is None
    assert check_patch_budget(pieces, 16, "error") is None
    assert check_patch_budget(pieces, 12, "drop") == check_patch_budget(pieces, 12, "split") == OVER_PATCH_BUDGET
    with pytest.raises(PatchBudgetError, match=r"^item 4 \(conversation 'c'\) has 16 vision patches, more than ") as e:
        check_patch_budget(pieces, 12, "error", who="item 4 (conversation 'c')")
    assert (e.value.conversation_id, e.value.patches, e.value.max_patches) == ("c", 16, 12)
    assert isinstance(e.value, ValueError)
    back = pickle.loads(pickle.dumps(e.value))  # crosses worker processes whole
    assert (type(back), str(back), back.patches, back.max_patches) == (PatchBudgetError, str(e.value), 16, 12)
