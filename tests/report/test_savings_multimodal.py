"""sftpack.report.savings for multimodal samples: every packer without and with a
vision-patch budget (the table of ``sftpack bench --corpus vqa``)."""

from __future__ import annotations

import numpy as np

from sftpack.binpack import Algorithm, pack
from sftpack.report.savings import compare_media_layouts, format_media_layouts, load_line


def test_each_packer_with_and_without_the_patch_budget():
    rng = np.random.default_rng(0)
    vision = rng.integers(16, 300, size=400)
    lengths = vision + rng.integers(10, 120, size=400)
    patches = 4 * vision  # Qwen2-VL: 4 patches per placeholder token after the 2x2 merge
    rows = compare_media_layouts(lengths, patches, vision, 1024, max_patches_per_row=2048, cost_multiple=4)
    assert [(r.layout, r.patch_budget) for r in rows] == [
        *((a.value, b) for a in Algorithm for b in (None, 2048)),
        ("one per row", None),
    ]
    for r in rows:
        expect = (
            pack(
                lengths,
                1024,
                r.layout,
                cost_multiple=4,
                **({} if r.patch_budget is None else {"weights": patches, "max_weight_per_bin": 2048}),
            )
            if r.layout != "one per row"
            else [np.array([i]) for i in range(400)]
        )
        per_row = [int(patches[np.asarray(b)].sum()) for b in expect]
        assert r.rows == len(expect), r
        assert r.fill == int(lengths.sum()) / (len(expect) * 1024)
        assert r.vision == int(vision.sum()) / (len(expect) * 1024)
        assert (r.patches_max, r.over_budget) == (max(per_row), sum(p > 2048 for p in per_row)), r
        if r.patch_budget is not None:
            assert r.patches_max <= 2048 and r.over_budget == 0
    by = {(r.layout, r.patch_budget): r for r in rows}
    assert by[("ffd", None)].over_budget > 0  # the budget binds on these samples ...
    assert by[("ffd", 2048)].rows > by[("ffd", None)].rows  # ... and costs rows
    text = format_media_layouts(rows, 1024)
    assert text.count("\n") == len(rows) + 2 and "one per row" in text  # header, rule, rows, the load
    assert text.splitlines()[-1] == load_line(rows) and "ffd + patch budget" in load_line(rows)
