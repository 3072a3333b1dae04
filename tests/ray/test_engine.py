"""The Ray engine on a real local Ray, for conversations with images: every file, the media
columns and the manifest, the same as the local engine's for num_proc 1 and 2 (the text
conversations: tests/ray/test_engine_text.py; a file apart so that the two slow files can run on two
test workers). Each Ray run costs 8-20 s here; it shares the folder's one Ray (``ray_cluster``)."""

from __future__ import annotations

import pytest

from sftpack.offline import PrepackedDataset, prepack
from sftpack.offline.engine import RayEngine


def test_images_local_num_proc_1_and_2_and_ray_write_the_same_bytes(ray_cluster, tmp_path):
    pytest.importorskip("easy_vqa")
    pytest.importorskip("PIL")
    from sftpack.multimodal import family_for, vqa_corpus

    convs = list(vqa_corpus(seed=4, limit=10, min_side=56, max_side=140))
    del convs[2]["id"]  # numbered by its place in the input, on every engine
    family_for().tokenizer()  # loaded once, before the local engine forks
    kw = {"images": True, "max_seq_len": 256, "pad_multiple": 4, "max_patches_per_row": 400, "overlong": "split"}
    one = prepack(convs, tmp_path / "local1", num_proc=1, **kw)
    two = prepack(convs, tmp_path / "local2", num_proc=2, **kw)
    ray = prepack(convs, tmp_path / "ray", engine=RayEngine(workers=2, unit_size=3, write_tasks=2), **kw)
    names = sorted(p.name for p in one.path.iterdir())
    assert "pixels.npy" in names and len(ray.writers) == 2
    for other in (two, ray):
        assert sorted(p.name for p in other.path.iterdir()) == names
        assert [n for n in names if (other.path / n).read_bytes() != (one.path / n).read_bytes()] == []
    ds = PrepackedDataset(ray.path, verify="full")
    assert ds.manifest["media"]["family"] == "qwen2_vl" and ds.manifest["counts"]["overlong"]["split"] >= 0
    assert sum(ds[i].validate().num_media_items for i in range(len(ds))) == ds.manifest["media"]["images"]
