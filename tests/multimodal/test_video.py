"""Video for the Qwen-VL families: frames as ``Qwen2VLVideoProcessor`` takes them, positions as
``get_rope_index`` computes them, packed rows equal to each sample alone.

transformers' ``Qwen2VLVideoProcessor`` cannot be imported here (it needs torchvision, which
has no build for this CPU torch), so its own ``sample_frames`` and ``patchify`` are read from
its source file and run as written (:func:`_hf_method`); the per-frame pixels are checked
against the real ``Qwen2VLImageProcessorPil`` (a video of one repeated frame is that image),
and decoding against transformers' own PyAV reader (``read_video_pyav``) on a clip encoded in
the test.

Samples are built by hand over a 48-id vocabulary (text ids 0-39 and the family's control
tokens): text-only, image-only, video and mixed samples, laid in rows and run as one flat run
through Hugging Face's own ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` (tiny, float64); the same through the loader's and the
trainer's rows and ``to_hf_kwargs()``; and conversations with a clip file and frames through
the media tokenizer (its renderer writes video parts as the family's video block).

Tolerance, fixed: 1e-10 in float64, the derivation of tests/multimodal/test_qwen2_5_vl.py
(u = 2**-53 = 1.1e-16; an n-term sum in any order is off by at most n*u of its terms'
magnitude sum, Higham, Accuracy and Stability, section 3.1). The longest chain of roundings
here is n <= 4,000: the patch embedding's 1,176-term dot products, width 32 over 2 vision and
2 text layers, frames of 16 patches (the tower's attention sums; its weight gradients sum over
<= 1,000 patches a row, asserted), segments <= 160 tokens (asserted), 48 vocabulary ids. So each
run is off by <= 4.4e-13 relative, the two by <= 8.9e-13, on logits and gradients of magnitude
<= 10 (asserted): <= 8.9e-12; 1e-10 is 11x that.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import types

import av
import numpy as np
import pytest
import torch
from PIL import Image

from sftpack import PackedBatch, Sample
from sftpack.handoff.payload import PatchMedia
from sftpack.multimodal import BadImageError, check_packed, family_for, tokenize_media_conversations
from sftpack.multimodal._images import resize_image
from sftpack.multimodal._plan import plan_rows
from sftpack.multimodal._video import VideoSampling, encode_videos, patchify_frames, sample_indices
from sftpack.multimodal.families.qwen2_vl import qwen2vl_image_processor as image_processor
from tests.helpers import packed_vs_alone
from tests.multimodal.conftest import noise_image

TOL = 1e-10  # float64; see the docstring
# What the negative controls move something by, at least: a video's temporal slices reversed
# changes its features (random noise frames: O(1) apart; observed 0.5 on the logits); positions
# without Qwen2.5-VL's temporal scaling move the temporal rotary dimensions of the video's tokens
# and what attends to them (observed 8e-4 on the logits): both far above any rounding (<= 9e-12).
BUG = 1e-6
V_START, V_END, IMG, VID, PAD, VOCAB = 40, 41, 42, 43, 44, 48
IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=V_START, vision_end_token_id=V_END)
PROC = image_processor(56 * 56, 112 * 112)  # frames of 56-112 px: 4-8 patches a side


# ------------------------------------------------------------------ HF's own code, read from its file
def _hf_method(cls_name: str, name: str, module: str = "transformers.models.qwen2_vl.video_processing_qwen2_vl"):
    """``cls_name.name`` from transformers' source file of ``module``, compiled as written (the
    module itself imports torchvision at the top). Its globals: ``math`` and ``torch``."""
    import importlib.util

    path = importlib.util.find_spec(module).origin
    tree = ast.parse(open(path, encoding="utf-8").read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    for a in fn.args.args + fn.args.kwonlyargs:  # annotations name torchvision types
        a.annotation = None
    fn.returns = None
    code = compile(ast.Module(body=[fn], type_ignores=[]), path, "exec")
    scope: dict = {"math": math, "torch": torch}
    exec(code, scope)
    defaults = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)
    }
    return scope[name], defaults


_noise = noise_image


def _frames(n: int, w: int, h: int, seed: int) -> list[Image.Image]:
    return [_noise(w, h, seed * 100 + i) for i in range(n)]


# ------------------------------------------------------------------ frames
def test_sampling_is_the_processors_rule():
    from transformers.video_utils import VideoMetadata

    hf, defaults = _hf_method("Qwen2VLVideoProcessor", "sample_frames")
    assert (defaults["min_frames"], defaults["max_frames"], defaults["temporal_patch_size"]) == (4, 768, 2)
    ours = VideoSampling()
    assert (ours.min_frames, ours.max_frames) == (defaults["min_frames"], defaults["max_frames"])
    me = types.SimpleNamespace(num_frames=None, fps=None, **defaults)
    cases = [(total, rate, fps) for total in (4, 5, 7, 8, 9, 30, 61, 100) for rate in (4.0, 24.0, 29.97)
             for fps in (0.5, 1.0, 2.0, 3.0, 30.0)]  # fmt: skip
    for total, rate, fps in cases:
        want = hf(me, VideoMetadata(total_num_frames=total, fps=rate), fps=fps).numpy()
        got = sample_indices(total, rate, fps, 2, ours)
        assert got.tolist() == want.tolist(), (total, rate, fps)
    # the clamps reached: at least min_frames, at most the frames there are, even counts
    assert sample_indices(100, 24.0, 0.1, 2, ours).tolist() == [0, 25, 50, 75]
    assert len(sample_indices(9, 4.0, 30.0, 2, ours)) == 8


@pytest.mark.parametrize("n", [1, 3, 4])
def test_patches_are_the_processors_layout(n):
    """The processor's own ``patchify`` (temporal padding by the last frame included) over the
    same normalised frames gives the same patches and grid."""
    hf, _ = _hf_method("Qwen2VLVideoProcessor", "patchify")
    resized = np.stack([resize_image(im, PROC) for im in _frames(n, 84, 56, seed=n)])
    ours, grid = patchify_frames(resized, PROC)
    from sftpack.multimodal._images import pixel_table

    values = torch.from_numpy(pixel_table(PROC)[np.arange(3), resized]).permute(0, 3, 1, 2)[None]  # (1, N, C, H, W)
    want, gt, gh, gw = hf(None, values.contiguous(), patch_size=14, merge_size=2, temporal_patch_size=2)
    assert grid.tolist() == [gt, gh, gw] == [-(-n // 2), 4, 6]
    np.testing.assert_array_equal(ours, want[0].numpy())


def test_a_still_video_is_the_image():
    """One frame repeated: patch for patch what the real image processor gives for that image."""
    frame = _noise(100, 60, 7)
    enc = encode_videos([{"type": "video", "frames": [frame, frame]}], PROC)
    ref = PROC(images=[frame], return_tensors="np")
    np.testing.assert_array_equal(enc.pixel_values, ref["pixel_values"])
    assert enc.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    odd = encode_videos([{"type": "video", "frames": [frame]}], PROC)  # padded by repeating it
    np.testing.assert_array_equal(odd.pixel_values, ref["pixel_values"])
    assert enc.second_per_grid_ts.tolist() == [np.float32(2 / 24)]  # no fps: the processor's 24


def _write_clip(path: str, n: int) -> str:
    """An ``n``-frame 56x56 clip at 4 fps, encoded by PyAV (mpeg4), each frame a different colour ramp."""
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        ramp = np.linspace(0, 255, 56, dtype=np.uint8)
        for i in range(n):
            img = np.stack([np.tile(ramp, (56, 1)), np.tile(ramp[:, None], (1, 56)), np.full((56, 56), 30 * i)], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img.astype(np.uint8), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """An 8-frame clip made here (:func:`_write_clip`)."""
    return _write_clip(str(tmp_path_factory.mktemp("video") / "clip.mp4"), 8)


@pytest.mark.parametrize("fps", [None, 2.0])
def test_an_encoded_clip_decodes_as_transformers_reads_it(clip, fps):
    from transformers.video_utils import read_video_pyav

    enc = encode_videos([{"type": "video", "path": clip, **({"fps": fps} if fps else {})}], PROC)
    keep = np.arange(8) if fps is None else np.arange(0, 8, 2)  # 8 frames / 4 fps * 2 fps = 4 frames
    frames, meta = read_video_pyav(clip, sample_indices_fn=lambda metadata, **kw: keep)
    assert (meta.total_num_frames, meta.fps) == (8, 4.0) and frames.shape == (len(keep), 56, 56, 3)
    assert enc.frames.tolist() == [len(keep)] and enc.grid_thw.tolist() == [[len(keep) // 2, 4, 4]]
    ref = encode_videos([{"type": "video", "frames": [Image.fromarray(f) for f in frames]}], PROC)
    np.testing.assert_array_equal(enc.pixel_values, ref.pixel_values)
    assert len({f[:, :, 2].mean().round() for f in frames}) == len(keep)  # distinct frames, in order
    sampled = len(keep) / 8 * 4.0  # HF's VideoMetadata.sampled_fps
    assert enc.second_per_grid_ts.tolist() == [np.float32(2 / sampled)]


def test_bad_video_parts_name_the_field(tmp_path):
    def err(part):
        with pytest.raises(BadImageError) as e:
            encode_videos([part], PROC, record="r", fields=["messages[0].content[1]"])
        return e.value

    e = err({"type": "video", "path": str(tmp_path / "none.mp4")})
    assert e.reason.value == "video_missing_file" and e.field == "messages[0].content[1].path"
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all")
    assert err({"type": "video", "path": str(junk)}).reason.value == "video_undecodable"
    e = err({"type": "video", "frames": [_noise(56, 56, 1), _noise(60, 56, 2)]})
    assert e.reason.value == "video_frame_sizes" and "one size" in str(e)
    assert err({"type": "video", "frames": [_noise(56, 56, 1)], "fps": -1}).reason.value == "video_bad_fps"
    assert err({"type": "video"}).reason.value == "video_no_source"
    assert err({"type": "video", "path": "https://example.com/a.mp4"}).reason.value == "video_url"
    one = _write_clip(str(tmp_path / "one.mp4"), 1)
    short = err({"type": "video", "path": one, "fps": 2})
    assert short.reason.value == "video_too_short" and "1 frame(s) sampled at 2 fps give fewer" in str(short)
    assert encode_videos([{"type": "video", "path": one}], PROC).grid_thw.tolist() == [[1, 4, 4]]  # unsampled: padded
    assert str(e).startswith("record 'r', messages[0].content[1].frames: ")


# ------------------------------------------------------------------ samples by hand
def _sample(family, items, seed: int, cid: str) -> Sample:
    """A sample of ``items``: ("text", n) user text, ("answer", n) trained text, ("image", PIL),
    ("video", part); images and videos in their vision blocks, placeholders expanded."""
    rng = np.random.default_rng(seed)
    enc_i = family.encode_images([x for k, x in items if k == "image"], PROC)
    enc_v = family.encode_videos([x for k, x in items if k == "video"], PROC)
    ids: list[int] = []
    mask: list[bool] = []
    runs: dict[str, list] = {"image": [], "video": []}
    for kind, x in items:
        if kind in ("text", "answer"):
            ids += rng.integers(0, 40, x).tolist()
            mask += [kind == "answer"] * x
            continue
        n = int((enc_i if kind == "image" else enc_v).tokens[len(runs[kind])])
        runs[kind].append((len(ids) + 1, n))
        ids += [V_START] + [IMG if kind == "image" else VID] * n + [V_END]
        mask += [False] * (n + 2)
    ids_a, mask_a = np.array(ids, np.int64), np.array(mask)
    if not runs["image"] and not runs["video"]:
        return Sample(ids_a, mask_a, cid)
    media = family.media(
        ids_a,
        np.array(runs["image"], np.int64).reshape(-1, 2),
        enc_i,
        IMG,
        videos=enc_v,
        video_runs=np.array(runs["video"], np.int64).reshape(-1, 2),
    )
    return Sample(ids_a, mask_a, cid, media=media)


def _items():
    v = lambda n, seed, **kw: ("video", {"type": "video", "frames": _frames(n, 56, 56, seed), **kw})  # noqa: E731
    return [
        [("text", 5), v(8, 1, fps=3), ("text", 3), ("answer", 6)],
        [("text", 9), ("answer", 12)],
        [("text", 2), ("image", _noise(84, 56, 2)), ("text", 4), v(5, 3, fps=2), ("answer", 7)],
        [("text", 3), ("image", _noise(56, 112, 4)), ("answer", 5)],
        [v(4, 5, fps=1), ("text", 2), ("image", _noise(56, 56, 6)), v(3, 7), ("answer", 9)],
        [("text", 6), ("answer", 4)],
    ]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def family_samples(request):
    fam = family_for(request.param)
    samples = [_sample(fam, items, seed, f"s{seed}") for seed, items in enumerate(_items())]
    model = fam.tiny_model(vocab_size=VOCAB, token_ids=IDS, dtype=torch.float64)
    return fam, samples, model


def test_media_items_in_text_order(family_samples):
    fam, samples, _ = family_samples
    m = samples[4].media
    assert isinstance(m, PatchMedia) and m.video.tolist() == [True, False, True] and m.video_token_id == VID
    assert m.grid_thw.tolist() == [[2, 4, 4], [1, 4, 4], [2, 4, 4]]  # 4 frames, an image, 3 frames padded to 4
    assert m.num_patches == 32 + 16 + 32 == m.pixel_values.shape[0]
    assert [int(np.float32(x) * 1e6) for x in m.second_per_grid_ts.tolist()] == [2000000, 0, 83333]
    assert samples[1].media is None and samples[3].media.num_videos == 0


def test_positions_equal_get_rope_index(family_samples):
    fam, samples, model = family_samples
    for s in samples:
        if s.media is None:
            continue
        ids = torch.from_numpy(s.input_ids)[None]
        kw = fam._alone_media(model, ids, s.media)
        extra = {"second_per_grid_ts": kw["second_per_grid_ts"]} if "second_per_grid_ts" in kw else {}
        want, _ = model.model.get_rope_index(
            ids,
            mm_token_type_ids=kw["mm_token_type_ids"],
            image_grid_thw=kw.get("image_grid_thw"),
            video_grid_thw=kw.get("video_grid_thw"),
            **extra,
        )
        assert torch.equal(s.media.positions, want[:, 0]), s.conversation_id
    if fam.name == "qwen2_5_vl":  # the temporal axis is scaled: 3 fps, 2 frames a slice, 2 per second
        t = samples[0].media.positions[0, samples[0].media.slots[0, 0] :][: 4 * 4 * 4 // 4]
        assert sorted(set((t - t[0]).tolist())) == [0, 1, 2, 4]  # int(k * 2 * 2/3): 0, 1.33, 2.67, 4


def test_the_temporal_scale_is_the_models(family_samples):
    """Qwen2.5-VL's family reads ``tokens_per_second`` from the model's config: positions of a
    model with 25 (not the family's default 2) still equal its ``get_rope_index``."""
    fam, _, _ = family_samples
    if fam.name != "qwen2_5_vl":
        return
    cfg = fam.config(VOCAB, IDS)
    cfg.vision_config.tokens_per_second = 25
    fam25 = family_for(cfg)
    assert (fam.tokens_per_second, fam25.tokens_per_second) == (2, 25)
    model = fam25.tiny_model(vocab_size=VOCAB, token_ids=IDS, dtype=torch.float64)
    assert model.config.vision_config.tokens_per_second == 25 and family_for(model).tokens_per_second == 25
    s = _sample(fam25, _items()[4], 4, "s4")
    ids = torch.from_numpy(s.input_ids)[None]
    kw = fam25._alone_media(model, ids, s.media)
    want, _ = model.model.get_rope_index(ids, **{k: v for k, v in kw.items() if "pixel" not in k})
    assert torch.equal(s.media.positions, want[:, 0])
    assert not torch.equal(s.media.positions, _sample(fam, _items()[4], 4, "s4").media.positions)


def test_video_counts_in_both_budgets(family_samples):
    _, samples, _ = family_samples
    lengths = [len(s) for s in samples]
    patches = [s.num_patches for s in samples]
    assert patches[0] == 64 and patches[2] == 24 + 48
    rows = plan_rows(lengths, patches, max_seq_len=200, max_patches_per_row=100)
    for r in rows:
        assert sum(patches[i] for i in r) <= 100 and sum(lengths[i] for i in r) <= 200
    assert sorted(i for r in rows for i in r) == list(range(len(samples))) and len(rows) >= 3


def _rows(samples):
    return [samples[:2], samples[2:4], samples[4:]]


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_packed_equals_alone(family_samples, pad_between_seqs):
    fam, samples, model = family_samples
    assert max(len(s) for s in samples) <= 160 and sum(s.num_patches for s in samples) <= 1000  # premises
    r = check_packed(model, samples, pad_between_seqs=pad_between_seqs, pad_multiple=4, rows=3, pad_id=PAD)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert set(r.grads) == {"language", "vision"}
    assert r.within(TOL), r


def _reversed_video(b: PackedBatch) -> PackedBatch:
    """The bug: the first video's two temporal slices swapped in the pixels (its frames out of order)."""
    m = b.media
    i = int(m.video.nonzero()[0])
    per = m.grid_thw.prod(dim=1)
    a = int(per[:i].sum())
    t, h, w = m.grid_thw[i].tolist()
    pv = m.pixel_values.clone()
    pv[a : a + t * h * w] = pv[a : a + t * h * w].reshape(t, h * w, -1).flip(0).reshape(t * h * w, -1)
    return dataclasses.replace(b, media=dataclasses.replace(m, pixel_values=pv))


def _unscaled_time(b: PackedBatch) -> PackedBatch:
    """The bug: every video's temporal positions step by one slice (Qwen2-VL's rule), not by time."""
    m = b.media
    pos = m.positions.clone()
    for i in m.video.nonzero().flatten().tolist():
        s, n = m.slots[i].tolist()
        t, h, w = m.grid_thw[i].tolist()
        first = int(pos[1, s])
        pos[0, s : s + n] = first + torch.arange(t).repeat_interleave(h * w // 4)
    return dataclasses.replace(b, media=dataclasses.replace(m, positions=pos))


def test_negative_controls_fail(family_samples):
    fam, samples, model = family_samples
    tampers = [_reversed_video] + ([_unscaled_time] if fam.name == "qwen2_5_vl" else [])
    for tamper in tampers:
        r = check_packed(model, samples, pad_multiple=4, rows=3, pad_id=PAD, tamper=tamper)
        assert not r.within(TOL) and r.worst > BUG, (tamper.__name__, r)


def test_pieces_and_rows_keep_the_videos(family_samples):
    fam, samples, _ = family_samples
    s = samples[2]
    m = s.media
    cut = int(m.slots[1, 0]) - 1  # just before the video's block: its <|vision_start|>
    a, b = m.piece(0, cut), m.piece(cut, len(s))
    assert a.video.tolist() == [False] and b.video.tolist() == [True] and b.video_token_id == VID
    assert torch.equal(b.second_per_grid_ts, m.second_per_grid_ts[1:])
    assert torch.equal(torch.cat([a.pixel_values, b.pixel_values]), m.pixel_values)
    Sample(s.input_ids[cut:], s.loss_mask[cut:], "piece", media=b)  # checks itself
    row = PackedBatch.from_samples(samples, pad_multiple=4, pad_id=PAD).validate()
    assert row.media.video.tolist() == [x for q in samples if q.media is not None for x in q.media.video.tolist()]
    kw = row.media.hf_kwargs(row.position_ids)
    assert kw["video_grid_thw"].shape[0] == int(row.media.video.sum()) and "pixel_values_videos" in kw
    assert kw["pixel_values"].shape[0] + kw["pixel_values_videos"].shape[0] == row.media.num_patches


def test_each_run_is_checked_against_its_own_placeholder(family_samples):
    _, samples, _ = family_samples
    s = samples[0]
    with pytest.raises(ValueError, match=r"slots\[0\] = \[6, 22\) is not a run of placeholder 42"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, video=torch.tensor([False])))
    with pytest.raises(ValueError, match="video_token_id must be an int when an item is a video"):
        Sample(s.input_ids, s.loss_mask, "x", media=dataclasses.replace(s.media, video_token_id=None))
    trained = s.loss_mask.copy()
    trained[int(s.media.slots[0, 0])] = True
    with pytest.raises(ValueError, match="placeholder tokens of an item's run are marked trainable"):
        Sample(s.input_ids, trained, "x", media=s.media)


# ------------------------------------------------------------------ through the tokenizer
@pytest.fixture(scope="module")
def tokenized(clip):
    """Conversations with a video file, frames, images and none, tokenized by the family (its
    default tokenizer and image processor), then renumbered onto the ids they use."""
    frames = _frames(5, 84, 56, seed=9)

    def conv(cid, *parts, answer="It moves."):
        return {"id": cid, "messages": [{"role": "user", "content": list(parts)},
                                        {"role": "assistant", "content": answer}]}  # fmt: skip

    text = {"type": "text", "text": "What happens?"}
    convs = [
        conv("clip", {"type": "video", "path": clip, "fps": 2}, text),
        conv("text", text, answer="Nothing."),
        conv("frames", text, {"type": "video", "frames": frames, "fps": 3}, {"type": "image", "image": frames[0]}),
        conv("image", {"type": "image", "image": _noise(56, 84, 3)}, text),
    ]
    out = {}
    for name in ("qwen2_vl", "qwen2_5_vl"):
        fam = family_for(name)
        tok = fam.tokenizer()
        samples = list(tokenize_media_conversations(convs, family=fam, processor=PROC))
        specials = tok.convert_tokens_to_ids(["<|endoftext|>", "<|image_pad|>", "<|video_pad|>",
                                              "<|vision_start|>", "<|vision_end|>"])  # fmt: skip
        vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(specials)]))
        new = dict(zip(["pad", "image", "video", "start", "end"], np.searchsorted(vocab, specials).tolist()))

        def renumber(s, vocab=vocab, new=new):
            m = s.media
            if m is not None:
                m = dataclasses.replace(m, token_id=new["image"], video_token_id=new["video"] if m.num_videos else None)
            return Sample(np.searchsorted(vocab, s.input_ids), s.loss_mask, s.conversation_id, media=m)

        ids = dict(image_token_id=new["image"], video_token_id=new["video"], vision_start_token_id=new["start"],
                   vision_end_token_id=new["end"])  # fmt: skip
        model = fam.tiny_model(vocab_size=len(vocab), token_ids=ids, dtype=torch.float64)
        out[name] = (fam, [renumber(s) for s in samples], model, new["pad"], tok)
    return out


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_tokenized_video_conversations_pack_exactly(tokenized, name):
    fam, samples, model, pad, tok = tokenized[name]
    clip_s = samples[0]
    assert clip_s.media.video.tolist() == [True] and clip_s.media.grid_thw.tolist() == [[2, 4, 4]]  # 4 of 8 frames
    assert clip_s.media.second_per_grid_ts.tolist() == [1.0]  # 2 frames a slice at 2 fps sampled
    assert samples[2].media.video.tolist() == [True, False] and samples[1].num_patches == 0
    assert max(len(s) for s in samples) <= 160 and sum(s.num_patches for s in samples) <= 1000  # premises
    for pad_between_seqs in (True, False):
        r = check_packed(model, samples, pad_between_seqs=pad_between_seqs, pad_multiple=4, rows=2, pad_id=pad)
        assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
        assert r.within(TOL), (pad_between_seqs, r)
    r = check_packed(model, samples, pad_multiple=4, rows=2, pad_id=pad, tamper=_reversed_video)
    assert not r.within(TOL) and r.worst > BUG, r


def test_the_rows_hf_kwargs_run_the_model_as_is(family_samples):
    """``to_hf_kwargs()`` of a row with images and videos goes straight into the model (sdpa:
    boundaries from the restarts of the text position row; the model runs its tower on
    ``pixel_values`` and ``pixel_values_videos`` apart): each sample's logits equal it alone."""
    fam, samples, model = family_samples
    sdpa = fam.tiny_model(vocab_size=VOCAB, token_ids=IDS, dtype=torch.float64, text_attention="sdpa")
    sdpa.load_state_dict(model.state_dict())
    row = PackedBatch.from_samples(samples, pad_multiple=4, pad_id=PAD).validate()
    kw = row.to_hf_kwargs()
    assert kw["video_grid_thw"].tolist() == row.media.grid_thw[row.media.video].tolist()
    keys = ("input_ids", "position_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    with torch.no_grad():
        logits = sdpa(**{k: kw[k] for k in keys}, use_cache=False).logits[0]
        cu, cup = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
        for i, s in enumerate(samples):
            alone = fam.alone_logits(sdpa, s)
            assert float((logits[cup[i] : cup[i] + cu[i + 1] - cu[i]] - alone).abs().max()) <= TOL, i


def test_the_loader_and_trainer_paths_carry_videos(family_samples):
    """The loader's rows (under a token and a patch budget) and the trainer's packed padded batch,
    each row through the family's packed run, equal their samples alone (logits, loss, gradients)."""
    from sftpack.loader import PackingDataset
    from sftpack.trainer import pack_step

    fam, samples, model = family_samples
    by_id = {s.conversation_id: s for s in samples}
    ds = PackingDataset(samples, max_seq_len=80, buffer_size=6, max_patches_per_row=100, pad_multiple=4)
    rows = list(ds)
    assert sorted(c for r in rows for c in r.sequence_ids) == sorted(by_id) and len(rows) >= 3
    assert all(r.media is None or r.media.num_patches <= 100 for r in rows)
    assert any(r.media is not None and r.media.num_videos for r in rows)
    S = max(len(s) for s in samples)
    ids = torch.full((len(samples), S), PAD)
    mask = torch.zeros((len(samples), S), dtype=torch.bool)
    for b, s in enumerate(samples):
        ids[b, : len(s)], mask[b, : len(s)] = torch.from_numpy(s.input_ids), torch.from_numpy(s.loss_mask)
    step = pack_step(ids, [len(s) for s in samples], mask, pad_multiple=4, pad_id=PAD,
                     sequence_ids=[s.conversation_id for s in samples], media=[s.media for s in samples])  # fmt: skip
    for row in [*rows, step]:
        items = [by_id[c] for c in row.sequence_ids]
        d_logit, d_loss, grads = packed_vs_alone(fam, model, items, row)
        assert max(d_logit, d_loss, *grads.values()) <= TOL, (row.sequence_ids, d_logit, d_loss, grads)
