"""What a prepack stores of a sample's media (:mod:`sftpack.multimodal._stored`): uint8 pixels
that give back the processor's own values bit for bit, for a patch family's images (kept by the
:class:`PixelRecorder` while resizing, or turned back from the patches: the same bytes) and a
fixed-size image family's (LLaVA's CLIP processor, Gemma 3's), and values no uint8 pixel gives
refused."""

from __future__ import annotations

import numpy as np
import pytest

from sftpack.multimodal import family_for
from sftpack.multimodal._images import pixel_table, process_images
from sftpack.multimodal._stored import PixelRecorder, image_values, stored_items, table_pixels
from sftpack.multimodal.families.qwen2_vl import qwen2vl_image_processor as image_processor
from tests.multimodal.conftest import noise_image

IMAGES = [noise_image(60, 90, 1), noise_image(120, 56, 2), noise_image(33, 200, 3)]


def test_the_recorder_keeps_the_pixels_the_patches_are_made_of():
    proc = image_processor(56 * 56, 224 * 224)
    rec = PixelRecorder(proc)
    out = rec(images=IMAGES, return_tensors="np")
    ref = process_images(IMAGES, proc)  # the processor's own patches
    np.testing.assert_array_equal(out["image_grid_thw"], ref.image_grid_thw)
    assert out["pixel_values"].shape == (ref.pixel_values.shape[0], 0)  # no values made
    fam = family_for("qwen2_vl")
    enc = fam.encode_images(IMAGES, proc)
    starts = np.concatenate([[0], np.cumsum(enc.tokens)[:-1]])
    media = fam.media(np.zeros(int(enc.tokens.sum()), np.int64), np.stack([starts, enc.tokens], axis=1), enc, 0)
    kept = stored_items(media, proc, images=rec.pixels)
    turned_back = stored_items(media, proc)
    assert len(kept.pixels) == len(turned_back.pixels) == 3
    for a, b in zip(kept.pixels, turned_back.pixels):
        assert a.dtype == np.uint8 and np.array_equal(a, b)


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_fixed_size_image_gives_back_its_values_bit_for_bit(name):
    fam = family_for(name)
    proc = fam.image_processor()
    enc = fam.encode_images(IMAGES, proc)
    runs = np.stack([np.arange(3) * fam.image_tokens, np.full(3, fam.image_tokens)], axis=1)
    ids = np.zeros(3 * fam.image_tokens, np.int64)
    media = fam.media(ids, runs, enc, 7)
    items = stored_items(media, proc)
    assert items.grids.tolist() == [[1, 1, fam.image_tokens]] * 3 and not items.video.any()
    table = pixel_table(proc)
    for px, want in zip(items.pixels, enc.pixel_values):
        assert px.shape == (1, *want.shape[1:], 3)
        assert np.array_equal(image_values(px[0], table).view(np.uint32), want.view(np.uint32))


def test_values_no_pixel_gives_are_refused():
    proc = image_processor()
    table = pixel_table(proc)
    values = table[np.arange(3), np.full(3, 17)].reshape(1, 1, 3).copy()
    assert table_pixels(values, table).tolist() == [[[17, 17, 17]]]
    values[0, 0, 1] = np.nextafter(values[0, 0, 1], np.float32(10))  # one ulp off: no uint8 pixel gives it
    with pytest.raises(ValueError, match="channel 1 holds values that no uint8 pixel normalises to"):
        table_pixels(values, table)


@pytest.mark.parametrize("sides", [(56, 56), (28, 400), (448, 449), (1000, 30), (57, 91), (300, 300)])
def test_the_resize_is_the_processors_own_byte_for_byte(sides):
    """``resize_image`` resizes an RGB image with PIL straight to the processor's ``smart_resize``
    size: the same bytes as the processor's own steps (to an array, its resize, back), for sizes
    under, inside and over its pixel limits, and for Qwen3-VL's patch 16."""
    from sftpack.multimodal._images import resize_image

    w, h = sides
    im = noise_image(w, h, w * 1000 + h)
    for proc in (image_processor(56 * 56, 224 * 224), family_for("qwen3_vl").image_processor()):
        chw = proc.process_image(im, do_convert_rgb=True)
        factor = int(proc.patch_size * proc.merge_size)
        own = np.moveaxis(proc.resize(chw, size=proc.size, resample=proc.resample, factor=factor), 0, -1)
        mine = resize_image(im, proc)
        assert mine.dtype == np.uint8 and mine.shape == own.shape and np.array_equal(mine, own)
