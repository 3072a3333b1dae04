"""Images as a user gives them: EXIF orientation, odd shapes and resizes, large and
non-image files, where paths are read from, URLs, and the processor the user passes.

The references are transformers' own: ``transformers.image_utils.load_image`` (which
applies the EXIF orientation) and the PIL image processor ``Qwen2VLImageProcessorPil``.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from sftpack.chat import read_conversations
from sftpack.multimodal import (
    BadImageError,
    MediaTokenizeStats,
    load_image,
    tokenize_media_conversation,
    tokenize_media_conversations,
)
from sftpack.multimodal._images import MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, process_images

transformers = pytest.importorskip("transformers")
from transformers.image_utils import load_image as hf_load_image  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402


def _pixels(w: int, h: int) -> Image.Image:
    """An RGB image whose every pixel differs from its neighbours (a rotation shows)."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + 2 * y) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


def _encoded(img: Image.Image, fmt: str = "PNG", orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    if orientation is None:
        img.save(buf, format=fmt)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation  # the EXIF Orientation tag
        img.save(buf, format=fmt, exif=exif)
    return buf.getvalue()


def _conv(*images: dict) -> list[dict]:
    return [
        {"role": "user", "content": [*images, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A shape."},
    ]


def _bad(part: dict, tok, proc) -> BadImageError:
    """The error for a conversation holding ``part`` (record 'bad-1'), after checking that
    skip mode counts it under the same reason and keeps the good conversation."""
    good = {"id": "good", "messages": _conv({"type": "image", "bytes": _encoded(_pixels(56, 56))})}
    bad = {"id": "bad-1", "messages": _conv(part)}
    with pytest.raises(BadImageError) as e:
        list(tokenize_media_conversations([good, bad], tokenizer=tok, processor=proc))
    st = MediaTokenizeStats()
    out = list(tokenize_media_conversations([good, bad], tokenizer=tok, processor=proc, on_bad_row="skip", stats=st))
    assert [s.conversation_id for s in out] == ["good"]
    assert (st.read, st.kept, st.dropped) == (2, 1, {e.value.reason.value: 1})
    assert "'bad-1'" in str(e.value)
    return e.value


# ------------------------------------------------------------------ EXIF orientation


@pytest.mark.parametrize("orientation", [6, 8])
def test_a_rotated_jpeg_is_turned_upright_as_transformers_load_image_does(tmp_path, tok, proc, orientation):
    """Stored 224 wide and 112 high with orientation 6 or 8: upright it is 112 wide, 224 high."""
    path = tmp_path / "photo.jpg"
    path.write_bytes(_encoded(_pixels(224, 112), "JPEG", orientation))
    want = hf_load_image(str(path))
    assert want.size == (112, 224)
    for part in ({"path": str(path)}, {"bytes": path.read_bytes()}, {"image": Image.open(path)}):
        got = load_image({"type": "image", **part})
        assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(want)), part.keys()
    hf = Qwen2VLImageProcessorPil(min_pixels=proc.size["shortest_edge"], max_pixels=proc.size["longest_edge"])
    ref = hf(images=[want], return_tensors="np")
    (s,) = tokenize_media_conversation(_conv({"type": "image", "path": str(path)}), tokenizer=tok, processor=proc)
    assert s.media.grid_thw.tolist() == ref["image_grid_thw"].tolist() == [[1, 16, 8]]
    assert s.media.pixel_values.numpy().tobytes() == np.asarray(ref["pixel_values"], np.float32).tobytes()


def test_a_pil_image_given_is_not_changed_in_place(tmp_path):
    img = Image.open(io.BytesIO(_encoded(_pixels(64, 32), "JPEG", 6)))
    img.load()
    before = np.asarray(img).copy()
    assert load_image({"type": "image", "image": img}).size == (32, 64)
    assert img.size == (64, 32) and np.array_equal(np.asarray(img), before)


# ------------------------------------------------------------------ shapes and resizes


def test_an_aspect_ratio_over_the_limit_is_a_bad_image_not_a_bad_record(tok, proc):
    assert MAX_ASPECT_RATIO == 200  # Qwen2-VL's smart_resize refuses more
    err = _bad({"type": "image", "bytes": _encoded(_pixels(402, 2))}, tok, proc)
    assert err.reason.value == "image_aspect_ratio" and err.field == "messages[0].content[0].bytes"
    assert "402x2" in str(err) and "201" in str(err) and "crop" in str(err)
    # exactly the limit is fine
    (s,) = tokenize_media_conversation(
        _conv({"type": "image", "bytes": _encoded(_pixels(400, 2))}), tokenizer=tok, processor=proc
    )
    assert s.media.num_items == 1


def test_a_resize_to_an_aspect_ratio_over_the_limit_names_the_resize(tok, proc):
    err = _bad({"type": "image", "bytes": _encoded(_pixels(56, 56)), "resize": [1000, 4]}, tok, proc)
    assert err.reason.value == "image_aspect_ratio" and err.field == "messages[0].content[0].resize"


@pytest.mark.parametrize("resize", [["a", 10], [10], "56x56", [0, 10], [10.5, 10], [True, 10], [100_000, 100_000]])
def test_a_resize_that_is_not_two_positive_sizes_is_a_bad_image(tok, proc, resize):
    err = _bad({"type": "image", "bytes": _encoded(_pixels(56, 56)), "resize": resize}, tok, proc)
    assert err.reason.value == "image_bad_resize" and err.field == "messages[0].content[0].resize"
    assert repr(resize)[:20] in str(err) and "[width, height]" in str(err)


# ------------------------------------------------------------------ size limit and the format header


def _sparse(path, size: int, head: bytes) -> None:
    """A file of ``size`` bytes that takes no disk (and no memory until read)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def _peak_python_bytes(fn) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        err: BaseException | None = e
    else:
        err = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, err


def test_a_large_non_image_file_is_refused_by_its_header_without_being_read(tmp_path):
    path = tmp_path / "notes.png"
    _sparse(path, 64 << 20, b"just some text, not an image\n")
    load_image({"type": "image", "bytes": _encoded(_pixels(8, 8))})  # PIL's plugins loaded before measuring
    peak, err = _peak_python_bytes(lambda: load_image({"type": "image", "path": str(path)}, "r", "img"))
    assert isinstance(err, BadImageError) and err.reason.value == "image_undecodable"
    assert "not an image" in str(err) and "b'just som" in str(err)
    assert peak < 4 << 20  # the old reader held the whole 64 MiB


def test_a_file_over_the_stated_maximum_is_refused_before_it_is_read(tmp_path, tok, proc):
    assert MAX_IMAGE_BYTES == 256 << 20
    path = tmp_path / "huge.png"
    _sparse(path, MAX_IMAGE_BYTES + 1, _encoded(_pixels(8, 8)))
    peak, err = _peak_python_bytes(lambda: load_image({"type": "image", "path": str(path)}, "r", "img"))
    assert isinstance(err, BadImageError) and err.reason.value == "image_too_large" and peak < 4 << 20
    assert f"{MAX_IMAGE_BYTES + 1:,} bytes" in str(err) and "256 MiB" in str(err)
    err = _bad({"type": "image", "path": str(path)}, tok, proc)
    assert err.reason.value == "image_too_large" and err.field == "messages[0].content[0].path"
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:  # bytes over the maximum are refused too, without a copy
            peak, err = _peak_python_bytes(lambda: load_image({"type": "image", "bytes": view}))
        finally:
            view.release()
    assert isinstance(err, BadImageError) and err.reason.value == "image_too_large" and peak < 4 << 20


def test_an_image_file_at_the_maximum_is_still_read_from_its_path(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(_encoded(_pixels(30, 20)))
    img = load_image({"type": "image", "path": path})
    assert img.size == (30, 20) and np.array_equal(np.asarray(img), np.asarray(_pixels(30, 20)))


# ------------------------------------------------------------------ paths, bytes and URLs


def test_a_missing_jsonl_image_names_the_path_read_relative_to_the_file(tmp_path, monkeypatch, tok, proc):
    data = tmp_path / "data"
    data.mkdir()
    row = {"messages": _conv({"type": "image", "path": "imgs/gone.png"})}
    (data / "chat.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadImageError) as e:
        list(tokenize_media_conversations(read_conversations("data/chat.jsonl"), tokenizer=tok, processor=proc))
    msg = str(e.value)
    assert repr(os.fspath(data / "imgs" / "gone.png")) in msg and "working directory" not in msg
    assert e.value.reason.value == "image_missing_file"


def test_a_relative_path_given_directly_is_read_from_the_working_directory_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadImageError, match="no file 'gone.png' in the working directory") as e:
        load_image({"type": "image", "path": "gone.png"}, "r", "img")
    assert repr(os.fspath(tmp_path)) in str(e.value)


def test_a_string_under_bytes_is_not_read_as_a_path(tmp_path, monkeypatch, tok, proc):
    (tmp_path / "a.png").write_bytes(_encoded(_pixels(56, 56)))
    monkeypatch.chdir(tmp_path)
    err = _bad({"type": "image", "bytes": "a.png"}, tok, proc)
    assert err.reason.value == "image_no_source" and err.field == "messages[0].content[0].bytes"
    assert '"bytes" holds a str' in str(err) and '"path"' in str(err)


@pytest.mark.parametrize(
    "url", ["ftp://example.com/a.png", "file:///tmp/a.png", "s3://bucket/a.png", "HTTPS://x/a.png"]
)
def test_any_url_is_a_url_not_a_missing_file(tmp_path, tok, proc, url):
    for key in ("path", "image"):
        err = _bad({"type": "image", key: url}, tok, proc)
        assert err.reason.value == "image_url" and err.field == f"messages[0].content[0].{key}"
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": _conv({"type": "image", "path": url})}) + "\n")
    assert list(read_conversations(path, on_bad_row="skip")) == []
    with pytest.raises(ValueError, match=r"content\[0\]\.path: a URL"):
        list(read_conversations(path))


def test_a_windows_drive_path_is_not_a_url(tmp_path):
    with pytest.raises(BadImageError) as e:
        load_image({"type": "image", "path": "C:\\images\\a.png"})
    assert e.value.reason.value == "image_missing_file"


# ------------------------------------------------------------------ the processor the user passes


def _images() -> list[Image.Image]:
    return [_pixels(70, 40), _pixels(56, 120), _pixels(300, 90)]


def _own(processor, images) -> tuple[bytes, list]:
    out = processor(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32).tobytes(), out["image_grid_thw"].tolist()


def _mine(processor, images) -> tuple[bytes, list]:
    p = process_images(images, processor)
    return p.pixel_values.tobytes(), p.image_grid_thw.tolist()


class _PatchesReversed(Qwen2VLImageProcessorPil):
    """A processor of its own: the PIL processor with its patches in reverse order."""

    def patchify(self, image, patch_size, merge_size, temporal_patch_size):
        patches, gh, gw = super().patchify(image, patch_size, merge_size, temporal_patch_size)
        return patches[::-1], gh, gw


@pytest.mark.parametrize(
    "make",
    [
        lambda: Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448),
        lambda: Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=224 * 224, image_mean=[0.5] * 3),
        lambda: Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, do_normalize=False),
        lambda: Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448, do_resize=False, patch_size=10),
        lambda: _PatchesReversed(min_pixels=56 * 56, max_pixels=448 * 448),
    ],
    ids=["default", "other-settings", "no-normalize", "no-resize", "subclass"],
)
def test_the_patches_are_exactly_the_given_processors_own(make, tok):
    processor = make()
    images = _images()[:2] if processor.do_resize else [_pixels(80, 40)]
    assert _mine(processor, images) == _own(processor, images)
    (s,) = tokenize_media_conversation(_conv({"type": "image", "image": images[0]}), tokenizer=tok, processor=processor)
    assert (s.media.pixel_values.numpy().tobytes(), s.media.grid_thw.tolist()) == _own(processor, images[:1])


def test_a_subclass_is_not_taken_for_the_processor_it_extends():
    images = _images()
    theirs = _own(_PatchesReversed(min_pixels=56 * 56, max_pixels=448 * 448), images)
    assert theirs != _own(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448), images)


def test_a_prepack_refuses_a_processor_its_reader_cannot_reproduce(tmp_path):
    """A prepack stores resized pixels and re-makes patches the PIL processor's way: with another
    processor its rows would not be that processor's patches, so it is refused before any work."""
    from sftpack.offline import prepack

    conv = {"id": "c0", "messages": _conv({"type": "image", "image": _pixels(56, 56)})}
    with pytest.raises(ValueError, match=r"_PatchesReversed .* does not reproduce exactly: pass sftpack"):
        prepack([conv], tmp_path / "p", images=True, max_seq_len=256, processor=_PatchesReversed())
    assert not (tmp_path / "p").exists()
