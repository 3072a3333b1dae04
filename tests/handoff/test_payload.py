"""Media as one payload (:mod:`sftpack.handoff.payload`): laying parts in row order, moving, the
Hugging Face arguments, and checks that name the field and the numbers.

Samples here are hand-made (no image processor, no model): Qwen2-VL-shaped ones carry a
:class:`PatchMedia` (patches of width 6 = 3 x 2 x 1**2, grids, merge 2, MRoPE positions),
LLaVA-shaped ones an :class:`ImageMedia` (one ``(3, 4, 4)`` tensor per image, runs of 2).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sftpack import PackedBatch, Sample
from sftpack.handoff import PackedBatchError
from sftpack.handoff.payload import ImageMedia, Media, PatchMedia
from sftpack.multimodal.families.qwen2_vl import mrope_positions

IMG = 151655  # the placeholder (Qwen2-VL's <|image_pad|>)
PAD = 151643


def _patch_sample(cid: int, pre: list[int], grids: list[tuple[int, int, int]], post=(7, 8)) -> Sample:
    """Ids ``pre`` + one placeholder run per grid (t*h*w/4 tokens, then a 3) + ``post`` (trained)."""
    ids, runs = list(pre), []
    for g in grids:
        n = int(np.prod(g)) // 4
        runs.append((len(ids), n))
        ids += [IMG] * n + [3]
    ids += list(post)
    patches = sum(int(np.prod(g)) for g in grids)
    pv = np.arange(patches * 6, dtype=np.float32).reshape(patches, 6) + 1000 * cid
    mask = np.zeros(len(ids), bool)
    mask[-len(post) :] = True
    runs_a = np.array(runs, np.int64).reshape(-1, 2)
    grid_a = np.array(grids, np.int64).reshape(-1, 3)
    media = PatchMedia(
        pixel_values=pv,
        slots=runs_a,
        sequence=np.zeros(len(runs), np.int64),
        token_id=IMG,
        grid_thw=grid_a,
        merge_size=2,
        positions=mrope_positions(len(ids), runs_a, grid_a, 2),
    )
    return Sample(np.array(ids), mask, cid, media=media)


def _image_sample(cid: int, pre: list[int], images: int, post=(7, 8)) -> Sample:
    ids, runs = list(pre), []
    for _ in range(images):
        runs.append((len(ids), 2))
        ids += [IMG, IMG, 3]
    ids += list(post)
    pv = torch.arange(images * 48, dtype=torch.float32).reshape(images, 3, 4, 4) + 1000 * cid
    mask = np.zeros(len(ids), bool)
    mask[-len(post) :] = True
    media = ImageMedia(pixel_values=pv, slots=runs, sequence=[0] * images, token_id=IMG)
    return Sample(np.array(ids), mask, cid, media=media)


def _patch_samples() -> list[Sample]:
    return [
        _patch_sample(0, [1, 2], [(1, 4, 4)]),
        _patch_sample(1, [1], [(1, 2, 4), (2, 2, 2)]),
        _patch_sample(2, [5, 6, 7], []),
        _patch_sample(3, [9], [(1, 2, 2)], post=(4, 5, 6)),
    ]


def _image_samples() -> list[Sample]:
    return [_image_sample(0, [1, 2], 1), _image_sample(1, [1], 2), _image_sample(2, [5, 6, 7], 0)]


def _fields(m: Media) -> dict:
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}


def _same_media(a: Media, b: Media) -> None:
    assert type(a) is type(b)
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), k
        else:
            assert x == y, k
    if isinstance(a, PatchMedia):
        assert torch.equal(a.vision_cu_seqlens, b.vision_cu_seqlens)


# ------------------------------------------------------------------ lay


@pytest.mark.parametrize("kind", ["patches", "images"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_rows_laid_end_to_end_are_the_row_of_all_samples(kind, pad_multiple):
    """Samples into rows, rows into a run: one operation. The concatenation of rows equals
    from_samples of all the samples, field for field (slots and segments shifted, positions
    continued through each padding)."""
    samples = _patch_samples() if kind == "patches" else _image_samples()
    rows = [
        PackedBatch.from_samples(samples[:2], pad_multiple=pad_multiple, pad_id=PAD),
        PackedBatch.from_samples(samples[2:], pad_multiple=pad_multiple, pad_id=PAD),
    ]
    run = PackedBatch.concat(rows).validate()
    whole = PackedBatch.from_samples(samples, pad_multiple=pad_multiple, pad_id=PAD).validate()
    assert torch.equal(run.input_ids, whole.input_ids) and torch.equal(run.cu_seqlens_padded, whole.cu_seqlens_padded)
    _same_media(run.media, whole.media)
    assert run.num_media_items == sum(s.media.num_items for s in samples)


def test_lay_is_what_from_samples_and_concat_call():
    samples = _patch_samples()
    row = PackedBatch.from_samples(samples, pad_multiple=4, max_seq_len=44, pad_id=PAD)
    cup = row.cu_seqlens_padded.tolist()
    laid = PatchMedia.lay(
        [s.media for s in samples],
        lengths=[len(s) for s in samples],
        offsets=cup[:-1],
        widths=np.diff(cup).tolist(),
        segments=[1] * len(samples),
    )
    _same_media(laid, row.media)
    # the last segment holds the row's tail padding: its positions continue through it
    last = samples[-1]
    a = cup[-2]
    top = int(last.media.positions.max()) + 1
    assert laid.positions[:, a + len(last) :].tolist() == [list(range(top, top + 44 - a - len(last)))] * 3
    assert laid.slots.tolist() == [[2, 4], [13, 2], [16, 2], [cup[3] + 1, 1]]
    assert laid.sequence.tolist() == [0, 1, 1, 3]
    # rows into a run: the same operation, a row holding several segments
    rows = [PackedBatch.from_samples(samples[:2], pad_id=PAD), PackedBatch.from_samples(samples[2:], pad_id=PAD)]
    sizes = [r.num_tokens for r in rows]
    joined = PatchMedia.lay(
        [r.media for r in rows], lengths=sizes, offsets=[0, sizes[0]], widths=sizes, segments=[2, 2]
    )
    _same_media(joined, PackedBatch.concat(rows).media)
    assert joined.sequence.tolist() == [0, 1, 1, 3]


def test_a_sample_without_media_takes_1d_positions_in_a_row_with_media():
    with_media = _patch_sample(0, [1, 2], [(1, 4, 4)])
    text = Sample(np.array([5, 6, 7, 8, 9]), np.array([0, 0, 1, 1, 1], bool), "t")
    row = PackedBatch.from_samples([with_media, text], pad_multiple=4, pad_id=PAD).validate()
    a = int(row.cu_seqlens_padded[1])
    assert row.media.num_items == 1 and row.media.sequence.tolist() == [0]
    assert row.media.positions[:, a:].tolist() == [list(range(row.num_tokens - a))] * 3


@pytest.mark.parametrize(
    "parts, match",
    [
        (lambda: [_patch_sample(0, [1], [(1, 2, 2)]).media, _image_sample(1, [1], 1).media], "kinds PatchMedia and "),
        (
            lambda: [_patch_sample(0, [1], [(1, 2, 2)]).media, dataclasses.replace(_patch_sample(1, [1], []).media, token_id=5)],
            "placeholder ids 151655 and 5",
        ),
        (
            lambda: [_patch_sample(0, [1], [(1, 2, 2)]).media, dataclasses.replace(_patch_sample(1, [1], []).media, merge_size=1)],
            r"merge sizes \[1, 2\]",
        ),
        (
            lambda: [_patch_sample(0, [1], [(1, 2, 2)]).media, dataclasses.replace(_patch_sample(1, [1], []).media, positions=None)],
            "some parts carry multimodal positions",
        ),
        (
            lambda: [_image_sample(0, [1], 1).media, dataclasses.replace(_image_sample(1, [1], 1).media, pixel_values=torch.zeros(1, 3, 8, 8))],
            "images of shapes",
        ),
        (lambda: [None, None], "at least one part with media"),
    ],
    ids=["mixed-kinds", "token-ids", "merge-sizes", "positions-some", "image-shapes", "no-media"],
)  # fmt: skip
def test_lay_refuses_parts_that_cannot_share_a_row(parts, match):
    ps = parts()
    n = len(ps)
    first = next((p for p in ps if p is not None), None)
    kind = PatchMedia if first is None else type(first)
    with pytest.raises(PackedBatchError, match=match):
        kind.lay(ps, lengths=[8] * n, offsets=[8 * i for i in range(n)], widths=[8] * n, segments=[1] * n)


# ------------------------------------------------------------------ devices


def test_to_copies_every_tensor_and_packedbatch_to_moves_the_media():
    row = PackedBatch.from_samples(_patch_samples(), pad_multiple=4, pad_id=PAD)
    m = row.media
    same = m.to("cpu")
    assert same is not m
    _same_media(same, m)
    moved = row.to("meta")  # a device without CUDA: shapes and dtypes, no data
    assert moved.media is not m and moved.media.device.type == "meta"
    assert all(t.device.type == "meta" for t in moved.media._tensors().values())
    assert {k: (t.shape, t.dtype) for k, t in moved.media._tensors().items()} == {
        k: (t.shape, t.dtype) for k, t in m._tensors().items()
    }
    assert moved.media.token_id == IMG and moved.media.merge_size == 2
    assert m.device.type == "cpu"  # the original stays
    images = PackedBatch.from_samples(_image_samples(), pad_id=PAD).to("meta")
    assert images.media.pixel_values.device.type == "meta" and images.media.slots.device.type == "meta"


def test_check_refuses_media_on_another_device_than_the_tokens():
    row = PackedBatch.from_samples(_patch_samples(), pad_id=PAD)
    split = dataclasses.replace(row, media=row.media.to("meta"))
    with pytest.raises(PackedBatchError, match=r"PackedBatch\.media tensors are on several devices"):
        split.validate()


# ------------------------------------------------------------------ hf_kwargs


def test_hf_kwargs_of_patch_media():
    row = PackedBatch.from_samples(_patch_samples(), pad_multiple=4, pad_id=PAD)
    m = row.media
    kw = m.hf_kwargs(row.position_ids)
    assert kw.keys() == {"position_ids", "pixel_values", "image_grid_thw"}
    assert kw["position_ids"].shape == (4, 1, row.num_tokens)  # Qwen2-VL's packed form
    assert torch.equal(kw["position_ids"][0, 0], row.position_ids) and torch.equal(
        kw["position_ids"][1:, 0], m.positions
    )
    assert kw["pixel_values"] is m.pixel_values and kw["image_grid_thw"] is m.grid_thw
    full = row.to_hf_kwargs()
    assert full["position_ids"] is not None and torch.equal(full["position_ids"], kw["position_ids"])
    # no items: the positions only; no positions (a model of 1-D positions): the pixels only
    empty = PackedBatch.from_samples([_patch_sample(2, [5, 6, 7], [])], pad_id=PAD)
    assert empty.media.hf_kwargs(empty.position_ids).keys() == {"position_ids"}
    flat = dataclasses.replace(m, positions=None)
    assert flat.hf_kwargs(row.position_ids).keys() == {"pixel_values", "image_grid_thw"}
    assert dataclasses.replace(row, media=flat).to_hf_kwargs()["position_ids"].shape == (1, row.num_tokens)


def test_hf_kwargs_of_image_media():
    row = PackedBatch.from_samples(_image_samples(), pad_id=PAD)
    kw = row.media.hf_kwargs(row.position_ids)
    assert kw.keys() == {"pixel_values"} and kw["pixel_values"] is row.media.pixel_values
    assert row.to_hf_kwargs()["position_ids"].shape == (1, row.num_tokens)  # the text's 1-D positions
    empty = PackedBatch.from_samples([_image_sample(2, [5, 6, 7], 0)], pad_id=PAD)
    assert empty.media.hf_kwargs(empty.position_ids) == {}


# ------------------------------------------------------------------ check


def _row() -> PackedBatch:
    return PackedBatch.from_samples(_patch_samples()[:2], pad_multiple=4, pad_id=PAD)


def _with(b: PackedBatch, **kw) -> PackedBatch:
    return dataclasses.replace(b, media=dataclasses.replace(b.media, **kw))


def _grid_sum_off(b):
    g = b.media.grid_thw.clone()
    g[0] = torch.tensor([1, 4, 8])  # 32 patches where the pixels hold 16: the sum is off
    return _with(b, grid_thw=g)


def _run_in_padding(b):
    """The last item's run moved into its segment's padding (placeholders written there too, and
    none left where it was; no label reads either place)."""
    ids = b.input_ids.clone()
    s, n = b.media.slots[-1].tolist()
    ids[s : s + n] = 0
    ids[b.num_tokens - n :] = IMG
    slots = b.media.slots.clone()
    slots[-1, 0] = b.num_tokens - n
    return _with(dataclasses.replace(b, input_ids=ids), slots=slots)


def _stray(b):
    ids = b.input_ids.clone()
    ids[0] = IMG
    return dataclasses.replace(b, input_ids=ids)


def _positions_not_restarting(b):
    pos = b.media.positions.clone()
    a = int(b.cu_seqlens_padded[1])
    pos[:, a:] += 3
    return _with(b, positions=pos)


@pytest.mark.parametrize(
    "edit, match",
    [
        (_grid_sum_off, r"PackedBatch\.media\.pixel_values has 32 patches but grid_thw holds 48 \(sum of t\*h\*w\)"),
        (_run_in_padding, r"PackedBatch\.media\.slots\[2\] = \[22, 24\) is not a run of placeholder 151655 inside "
                          r"the real tokens \[12, 21\) of segment 1"),
        (_stray, r"PackedBatch\.media: slot 0 holds the placeholder 151655 but lies in no item's run"),
        (_positions_not_restarting, r"PackedBatch\.media\.positions\[:, 12\] = \[3, 3, 3\] at the start of segment 1"),
        (lambda b: _with(b, token_id=True), r"PackedBatch\.media\.token_id must be an int"),
        (lambda b: _with(b, merge_size=0), r"PackedBatch\.media\.merge_size must be an int >= 1"),
        (lambda b: _with(b, grid_thw=b.media.grid_thw * torch.tensor([1, 1, 0])), r"grid_thw\[0\] = \[1, 4, 0\]"),
        (lambda b: _with(b, sequence=torch.tensor([0, 5, 5])), r"PackedBatch\.media\.sequence\[1\] = 5, not a segment of N=2"),
    ],
    ids=["grid-sum", "run-outside-segment", "stray-placeholder", "positions-not-restarting", "token-id", "merge",
         "grid-extent", "sequence"],
)  # fmt: skip
def test_check_names_the_field_and_the_numbers(edit, match):
    b = _row().validate()
    assert b.cu_seqlens.tolist() == [0, 9, 18] and b.cu_seqlens_padded.tolist() == [0, 12, 24]
    with pytest.raises(PackedBatchError, match=match):
        edit(b).validate()


def test_a_samples_check_names_the_sample_and_refuses_trainable_placeholders():
    s = _patch_sample(0, [1, 2], [(1, 4, 4)])
    with pytest.raises(ValueError, match=r"Sample 'x': media\.slots\[0\] has 3 placeholders but its grid"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, slots=[[2, 3]]))
    mask = s.loss_mask.copy()
    mask[3] = True
    with pytest.raises(
        ValueError, match=r"Sample 'x': media: placeholder tokens of an item's run are marked trainable"
    ):
        Sample(s.input_ids, mask, "x", media=s.media)
    with pytest.raises(ValueError, match=r"Sample 'x': media\.positions must have shape \(3, 9\)"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, positions=s.media.positions[:, 1:]))
    img = _image_sample(0, [1], 2)
    with pytest.raises(
        ValueError, match=r"Sample 'y': media\.slots\[1\] has 1 placeholders but every image takes the same 2"
    ):
        bad_ids = img.input_ids.copy()
        bad_ids[5] = 0
        Sample(bad_ids, img.loss_mask, "y", media=dataclasses.replace(img.media, slots=[[1, 2], [4, 1]]))


def test_sizes():
    s = _patch_sample(1, [1], [(1, 2, 4), (2, 2, 2)])
    m = s.media
    assert (m.num_items, m.num_patches, m.num_placeholders) == (2, 16, 4) and s.num_patches == 16
    assert m.vision_cu_seqlens.tolist() == [0, 8, 12, 16] and m.vision_cu_seqlens.dtype == torch.int32
    im = _image_sample(1, [1], 2).media
    assert (im.num_items, im.num_patches, im.num_placeholders) == (2, 4, 4) and im.vision_cu_seqlens is None
    assert Sample(np.array([1, 2]), np.array([0, 1], bool)).num_patches == 0
