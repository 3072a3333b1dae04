"""The family seam holds the family's own rules: a family that declares its own stored format
(``Family.stored_format``) or its own video rule (``Family.video_rule``) is written, read and
sampled by the shared code (the prepack writer and reader, the video sampling) without any change
there. Each family here is a tiny subclass of a real one, registered for the test only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack import PackedBatch  # noqa: E402
from sftpack.multimodal import vqa_corpus  # noqa: E402
from sftpack.multimodal._family import FAMILIES  # noqa: E402
from sftpack.multimodal._video import VideoRule, VideoSampling, frame_size, sample_indices  # noqa: E402
from sftpack.multimodal.families.qwen2_vl import QWEN2VL_STORED_FORMAT, Qwen2VL  # noqa: E402
from sftpack.offline import PrepackedDataset, PrepackError, prepack  # noqa: E402
from sftpack.offline._format import seal_manifest  # noqa: E402
from tests.multimodal.conftest import noise_image  # noqa: E402


class StoredOtherwise(Qwen2VL):
    """Qwen2-VL under another name, whose prepacks name a stored format of its own."""

    name = "qwen2_vl_stored_otherwise"
    model_types = ()  # Qwen2-VL's configs stay Qwen2-VL's
    stored_format = "probe-resized-uint8-hwc-v1"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(FAMILIES, StoredOtherwise.name, f"{__name__}:StoredOtherwise")


def _rows_equal(a: PackedBatch, b: PackedBatch) -> None:
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.numpy().tobytes() == y.numpy().tobytes(), name
    for name in ("pixel_values", "grid_thw", "positions", "slots"):
        x, y = getattr(a.media, name), getattr(b.media, name)
        assert x.numpy().tobytes() == y.numpy().tobytes(), f"media.{name}"


def test_a_familys_own_stored_format_is_written_checked_and_read_by_the_shared_code(registered, tmp_path):
    convs = list(vqa_corpus(seed=3, limit=6, min_side=56, max_side=112))
    kw = dict(images=True, max_seq_len=256, pad_multiple=4, max_patches_per_row=400, num_proc=1)
    own = prepack(convs, tmp_path / "own", family=StoredOtherwise.name, **kw).path
    ref = prepack(convs, tmp_path / "ref", family="qwen2_vl", **kw).path
    m_own = json.loads((own / "manifest.json").read_text())["media"]
    m_ref = json.loads((ref / "manifest.json").read_text())["media"]
    assert (m_own["kind"], m_own["family"]) == ("probe-resized-uint8-hwc-v1", StoredOtherwise.name)
    assert (m_ref["kind"], m_ref["family"]) == (QWEN2VL_STORED_FORMAT, "qwen2_vl")
    for name in ("pixels.npy", "images.npy", "row_images.npy", "tokens.npy"):  # the same bytes, another name
        assert (own / name).read_bytes() == (ref / name).read_bytes(), name
    a, b = PrepackedDataset(own, verify="full"), PrepackedDataset(ref, verify="full")
    assert type(a.media.family) is StoredOtherwise and len(a) == len(b) >= 1
    for r in range(len(a)):
        _rows_equal(a[r], b[r])
    # a manifest whose media.kind is not its family's stored format is refused, naming both
    bad = tmp_path / "bad"
    shutil.copytree(ref, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["media"]["kind"] = StoredOtherwise.stored_format
    (bad / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    with pytest.raises(PrepackError, match=r"media\.kind is 'probe-resized-uint8-hwc-v1', expected "
                       r"'qwen2vl-resized-uint8-hwc' \(what the qwen2_vl family stores\)"):  # fmt: skip
        PrepackedDataset(bad)


def test_the_stored_formats_are_the_families_own():
    from sftpack.multimodal import family_for, family_names

    formats = {name: family_for(name).stored_format for name in family_names()}
    assert formats == {  # the names prepacks were always written with: old prepacks still read
        "qwen2_vl": "qwen2vl-resized-uint8-hwc",
        "qwen2_5_vl": "qwen2vl-resized-uint8-hwc",
        "qwen3_vl": "qwen2vl-resized-uint8-hwc",
        "llava": "resized-uint8-hwc-table",
        "gemma3": "resized-uint8-hwc-table",
    }


class EveryOtherFrame(VideoRule):
    """A video rule of its own: every other frame from the first; every clip one fixed size."""

    def indices(self, total, file_fps, fps, temporal_patch, sampling):
        return np.arange(0, total, 2, dtype=np.int64)

    def frame_size(self, frames, height, width, limits, sampling, factor, temporal):
        return factor, 2 * factor


class OwnVideoRule(Qwen2VL):
    """Qwen2-VL under another name, whose videos follow a rule of its own."""

    name = "qwen2_vl_own_video_rule"
    model_types = ()
    video_rule = EveryOtherFrame()


@pytest.fixture
def own_rule(monkeypatch):
    monkeypatch.setitem(FAMILIES, OwnVideoRule.name, f"{__name__}:OwnVideoRule")


def test_a_familys_own_video_rule_samples_and_sizes_through_the_shared_code(own_rule):
    sized = VideoSampling(rule=OwnVideoRule.name, min_pixels=1024, max_pixels=200000)
    assert sample_indices(10, 24.0, 5.0, 2, sized).tolist() == [0, 2, 4, 6, 8]
    assert frame_size(4, 96, 128, sized, 28, 2) == (28, 56)
    # the same clip under Qwen2-VL's rule: other frames, another size (the rule is what changed)
    qwen = VideoSampling(rule="qwen2_vl", min_pixels=1024, max_pixels=200000)
    assert sample_indices(10, 24.0, 5.0, 2, qwen).tolist() != [0, 2, 4, 6, 8]
    assert frame_size(4, 96, 128, qwen, 28, 2) != (28, 56)
    # a whole conversation's video encoded by the family: its frames sized by its rule
    family = OwnVideoRule(video_sampling=sized)
    frames = [noise_image(128, 96, seed) for seed in range(4)]
    enc = family.encode_videos([{"type": "video", "frames": frames}], family.image_processor())
    assert enc.grid_thw.tolist() == [[2, 2, 4]]  # 4 frames in 2 temporal slices of 28 x 56 pixels (14-px patches)


def test_a_family_without_video_has_no_video_rule():
    with pytest.raises(ValueError, match="the llava family takes no video, so has no video rule"):
        sample_indices(10, 24.0, 5.0, 2, VideoSampling(rule="llava"))
    with pytest.raises(ValueError, match="VideoSampling.rule 'no_such': a family's name"):
        VideoSampling(rule="no_such")


class RefusesToStore(Qwen2VL):
    """Qwen2-VL under another name, whose media a prepack may not store."""

    name = "qwen2_vl_refuses_to_store"
    model_types = ()

    def check_stored(self, processor):
        raise ValueError(f"the {self.name} family's media are not stored ({type(processor).__name__})")


def test_whether_a_prepack_can_store_a_familys_media_is_the_familys_check(monkeypatch, tmp_path):
    monkeypatch.setitem(FAMILIES, RefusesToStore.name, f"{__name__}:RefusesToStore")
    convs = list(vqa_corpus(seed=3, limit=2, min_side=56, max_side=112))
    with pytest.raises(ValueError, match=r"the qwen2_vl_refuses_to_store family's media are not stored \(Qwen2VL"):
        prepack(convs, tmp_path / "p", images=True, family=RefusesToStore.name, max_seq_len=256, num_proc=1)
    assert not (tmp_path / "p" / "manifest.json").exists()
