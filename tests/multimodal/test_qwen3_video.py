"""Video for Qwen3-VL: frames sampled as ``Qwen3VLVideoProcessor`` samples them, the text
``Qwen3VLProcessor`` writes (a timestamp and a vision block per temporal slice), positions equal to
``Qwen3VLModel.get_rope_index`` and packed rows equal to each sample alone through Hugging Face's
own ``Qwen3VLForConditionalGeneration`` (tiny, float64; its deepstack maps on video tokens too).

transformers' ``Qwen3VLVideoProcessor`` cannot run here (it needs torchvision, which has no build
for this CPU torch), but its module imports: its own ``sample_frames`` runs as written on a
stand-in ``self`` holding the processor's defaults, and so do ``Qwen3VLProcessor.replace_video_token``
and ``_calculate_timestamps`` (the text rule, given the video's grid and metadata). The grid's
``h, w`` per frame are the real Qwen3-VL image processor's; decoding is transformers' own PyAV
reader (``read_video_pyav``) on a clip encoded in the test.

The alone run is Hugging Face's forward with ``pixel_values_videos`` and the processor's whole
``(t, h, w)`` video grids (the model splits them per slice for ``get_rope_index``); the packed run
has each slice as its own item of grid ``(1, h, w)``, the tower run once over the row.

Tolerance, fixed: 1e-10 in float64, the derivation of tests/multimodal/test_qwen3_vl.py (u =
2**-53; an n-term sum is off by at most n*u of its terms' magnitude sum, Higham, section 3.1):
the longest chain here is n <= 4,000 (the patch embedding's 1,536-term dot products, width 32 over
2 vision and 2 text layers, frames of 16 patches, images of <= 24, <= 1,000 patches a row and
segments <= 160 tokens, both asserted, a vocabulary of < 160 ids, asserted), so each run is off by
<= 4.4e-13 relative and the two by <= 8.9e-13, on logits and gradients of magnitude <= 10
(asserted): <= 8.9e-12; 1e-10 is 11x that.
"""

from __future__ import annotations

import dataclasses
import types
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav

from sftpack import PackedBatch, Sample
from sftpack.handoff.payload import PatchMedia
from sftpack.multimodal import check_packed, family_for, tokenize_media_conversations
from sftpack.multimodal._video import VideoSampling, sample_indices
from sftpack.multimodal.families.qwen3_vl import linspace_indices
from tests.multimodal.test_video import _frames, _noise, _write_clip

TOL = 1e-10  # float64; see the docstring
# What the negative controls move something by, at least: two slices of a video swapped (random
# noise frames, O(1) apart) or a video's slices placed as one grid (Qwen2-VL's positions) change the
# logits of the tokens after the video far above any rounding (<= 9e-12; observed above 1e-4).
BUG = 1e-6
SPECIALS = ("<|endoftext|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _hf_sampler() -> types.SimpleNamespace:
    """A stand-in ``self`` for ``Qwen3VLVideoProcessor.sample_frames`` with the class's own defaults."""
    c = Qwen3VLVideoProcessor
    return types.SimpleNamespace(fps=c.fps, min_frames=c.min_frames, max_frames=c.max_frames)


def test_sampling_is_the_processors_rule():
    me = _hf_sampler()
    fam = family_for("qwen3_vl")
    assert (fam.video_sampling.fps, fam.video_sampling.min_frames, fam.video_sampling.max_frames) == (
        me.fps,
        me.min_frames,
        me.max_frames,
    )
    cases = [(total, rate, fps) for total in (1, 3, 4, 5, 7, 8, 9, 30, 61, 100, 1000) for rate in (4.0, 24.0, 29.97)
             for fps in (0.5, 1.0, 2.0, 3.0, 30.0)]  # fmt: skip
    for total, rate, fps in cases:
        want = Qwen3VLVideoProcessor.sample_frames(me, VideoMetadata(total_num_frames=total, fps=rate), fps=fps)
        assert linspace_indices(total, rate, fps, fam.video_sampling).tolist() == want.tolist(), (total, rate, fps)
        assert sample_indices(total, rate, fps, 2, fam.video_sampling).tolist() == want.tolist()
    # the clamps reached, and Qwen2-VL's rule left as it was (a multiple of the temporal patch, from 0)
    assert linspace_indices(100, 24.0, 0.1, fam.video_sampling).tolist() == [0, 33, 66, 99]
    assert len(linspace_indices(9, 4.0, 30.0, fam.video_sampling)) == 9
    assert sample_indices(100, 24.0, 0.1, 2, VideoSampling()).tolist() == [0, 25, 50, 75]


# ------------------------------------------------------------------ conversations
@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """An 8-frame 56x56 clip at 4 fps (test_video's): at 2 fps Qwen3-VL keeps frames 0, 2, 5, 7."""
    return _write_clip(str(tmp_path_factory.mktemp("qwen3_video") / "clip.mp4"), 8)


def _conversations(clip: str) -> list[dict]:
    frames = _frames(5, 64, 64, seed=9)
    text = {"type": "text", "text": "What happens?"}

    def conv(cid, *parts, answer="It moves."):
        return {"id": cid, "messages": [{"role": "user", "content": list(parts)},
                                        {"role": "assistant", "content": answer}]}  # fmt: skip

    return [
        conv("clip", {"type": "video", "path": clip}, text),
        conv("text", text, answer="Nothing."),
        conv(
            "frames", text, {"type": "video", "frames": frames, "fps": 3}, {"type": "image", "image": _noise(64, 96, 3)}
        ),
        conv("image", {"type": "image", "image": _noise(96, 64, 4)}, text),
        conv(
            "two",
            {"type": "video", "frames": _frames(4, 64, 64, seed=5), "fps": 2},
            {"type": "video", "frames": _frames(2, 64, 64, seed=6)},
            text,
            answer="Two clips.",
        ),
        conv("clip3", text, {"type": "video", "path": clip, "fps": 3}),
    ]


@pytest.fixture(scope="module")
def qwen3(clip):
    """The conversations tokenized by the family (its tokenizer and image processor), renumbered onto
    the ids they use, and a tiny float64 model of that vocabulary."""
    fam = family_for("qwen3_vl")
    tok, proc = fam.tokenizer(), fam.image_processor()
    convs = _conversations(clip)
    raw = list(tokenize_media_conversations(convs, family=fam, processor=proc))
    specials = tok.convert_tokens_to_ids(list(SPECIALS))
    vocab = np.unique(np.concatenate([s.input_ids for s in raw] + [np.array(specials)]))
    pad, image, video, start, end = np.searchsorted(vocab, specials).tolist()

    def renumber(s):
        m = s.media
        if m is not None:
            m = dataclasses.replace(m, token_id=image, video_token_id=video if m.num_videos else None)
        return Sample(np.searchsorted(vocab, s.input_ids), s.loss_mask, s.conversation_id, media=m)

    ids = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    model = fam.tiny_model(vocab_size=len(vocab), token_ids=ids, dtype=torch.float64)
    return types.SimpleNamespace(
        fam=fam, tok=tok, proc=proc, convs=convs, raw=raw, samples=[renumber(s) for s in raw], model=model, pad=pad
    )


def _hf_text(q, conv: dict, clip: str) -> str:
    """What ``Qwen3VLProcessor`` makes of the conversation: the family's chat template rendered by
    the tokenizer, each ``<|video_pad|>`` replaced by ``replace_video_token`` (HF's code) over the
    video's grid and metadata (a file read by transformers' PyAV reader with the processor's own
    sampling; frames kept whole at the part's fps, ``do_sample_frames=False``), each
    ``<|image_pad|>`` by the real image processor's count."""
    parts = [p for m in conv["messages"] if isinstance(m["content"], list) for p in m["content"]]
    shown = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
              [p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]]}
             for m in conv["messages"]]  # fmt: skip
    text = q.tok.apply_chat_template(shown, chat_template=q.fam.default_chat_template(), tokenize=False)
    me = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
    )
    me._calculate_timestamps = partial(Qwen3VLProcessor._calculate_timestamps, me)
    sampler = _hf_sampler()
    for part in parts:
        if part["type"] == "image":
            grid = q.proc(images=[part["image"]], return_tensors="np")["image_grid_thw"][0]
            text = text.replace("<|image_pad|>", "\0" * int(grid.prod() // 4), 1)
            continue
        if part["type"] != "video":
            continue
        if "path" in part:
            sample = partial(Qwen3VLVideoProcessor.sample_frames, sampler, fps=part.get("fps"))  # None: its 2
            frames, meta = read_video_pyav(part["path"], sample_indices_fn=lambda metadata, **kw: sample(metadata))  # noqa: B023
            first = Image.fromarray(frames[0])
        else:
            n = len(part["frames"])
            meta = VideoMetadata(total_num_frames=n, fps=part.get("fps"), frames_indices=list(range(n)))
            first = part["frames"][0]
        _, h, w = q.proc(images=[first], return_tensors="np")["image_grid_thw"][0].tolist()
        t = -(-len(meta.frames_indices) // 2)
        inputs = {"video_grid_thw": np.array([[t, h, w]]), "video_metadata": [meta]}
        text = text.replace(
            "<|video_pad|>", Qwen3VLProcessor.replace_video_token(me, inputs, 0).replace("<|video_pad|>", "\1"), 1
        )
    return text.replace("\0", "<|image_pad|>").replace("\1", "<|video_pad|>")


def test_text_and_ids_are_the_processors(qwen3, clip):
    """Token for token what the processor's text tokenizes to, timestamps included; the clip keeps
    4 of its 8 frames (2 fps of 4), the 5 frames at 3 fps take 3 slices (the last padded)."""
    for conv, s in zip(qwen3.convs, qwen3.raw):
        want = _hf_text(qwen3, conv, clip)
        got = qwen3.tok.decode(s.input_ids.tolist())
        assert got == want, conv["id"]
        assert s.input_ids.tolist() == qwen3.tok(want)["input_ids"], conv["id"]
    clip_text = qwen3.tok.decode(qwen3.raw[0].input_ids.tolist())
    assert "<|vision_start|><0.2 seconds><|vision_start|>" in clip_text and "<1.5 seconds>" in clip_text
    at3 = qwen3.tok.decode(qwen3.raw[5].input_ids.tolist())  # frames 0, 1, 3, 4, 6, 7 of the 4-fps clip
    assert [x in at3 for x in ("<0.1 seconds>", "<0.9 seconds>", "<1.6 seconds>")] == [True] * 3
    frames = qwen3.tok.decode(qwen3.raw[2].input_ids.tolist())
    assert [x in frames for x in ("<0.2 seconds>", "<0.8 seconds>", "<1.3 seconds>")] == [True] * 3
    m = qwen3.raw[2].media
    assert m.video.tolist() == [True, True, True, False] and m.grid_thw.tolist() == [[1, 4, 4]] * 3 + [[1, 6, 4]]


def test_positions_equal_get_rope_index(qwen3):
    """Each sample's positions are the model's own ``get_rope_index`` on the processor's whole video
    grids (``_alone_media`` joins a video's slices back: ``(2, 4, 4)`` for the clip)."""
    fam, model = qwen3.fam, qwen3.model
    grids = {}
    for s in qwen3.samples:
        if s.media is None:
            continue
        ids = torch.from_numpy(s.input_ids)[None]
        kw = fam._alone_media(model, ids, s.media)
        grids[s.conversation_id] = kw.get("video_grid_thw", torch.zeros(0, 3)).tolist()
        want, _ = model.model.get_rope_index(
            ids,
            kw["mm_token_type_ids"],
            image_grid_thw=kw.get("image_grid_thw"),
            video_grid_thw=kw.get("video_grid_thw"),
        )
        assert torch.equal(s.media.positions, want[:, 0]), s.conversation_id
    assert grids["clip"] == [[2, 4, 4]] and grids["frames"] == [[3, 4, 4]] and grids["image"] == []
    assert grids["two"] == [[3, 4, 4]]  # two same-size videos back to back: one grid, the same slices
    two = next(s for s in qwen3.samples if s.conversation_id == "two")
    ids = torch.from_numpy(two.input_ids)[None]
    kw = fam._alone_media(model, ids, two.media)
    kw["video_grid_thw"] = torch.tensor([[2, 4, 4], [1, 4, 4]])  # the processor's: one grid per video
    want, _ = model.model.get_rope_index(ids, kw["mm_token_type_ids"], video_grid_thw=kw["video_grid_thw"])
    assert torch.equal(two.media.positions, want[:, 0])
    with torch.no_grad():
        apart = model(input_ids=ids, use_cache=False, **kw).logits[0]
        assert float((apart - fam.alone_logits(model, two)).abs().max()) <= TOL


def _swap_slices(b: PackedBatch) -> PackedBatch:
    """The bug: the first video's first two slices' pixels swapped (its frames out of order)."""
    m = b.media
    i = int(m.video.nonzero()[0])
    per = m.grid_thw.prod(dim=1)
    a, n = int(per[:i].sum()), int(per[i])
    pv = m.pixel_values.clone()
    pv[a : a + 2 * n] = torch.cat([m.pixel_values[a + n : a + 2 * n], m.pixel_values[a : a + n]])
    return dataclasses.replace(b, media=dataclasses.replace(m, pixel_values=pv))


def _one_grid(b: PackedBatch) -> PackedBatch:
    """The bug: a video's slices placed as one ``(t, h, w)`` grid (Qwen2-VL's positions, no split
    at the timestamps): each slice's temporal index steps by one from the first slice's start."""
    m = b.media
    pos = m.positions.clone()
    video = m.video.tolist()
    for i in range(1, m.num_items):
        if video[i] and video[i - 1]:
            s, n = m.slots[i].tolist()
            p, q = m.slots[i - 1].tolist()
            pos[:, s : s + n] = pos[:, p : p + q] + torch.tensor([[1], [0], [0]])
    return dataclasses.replace(b, media=dataclasses.replace(m, positions=pos))


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_packed_equals_alone(qwen3, pad_between_seqs):
    samples = qwen3.samples
    assert max(len(s) for s in samples) <= 160 and sum(s.num_patches for s in samples) <= 1000  # premises
    assert qwen3.model.config.text_config.vocab_size < 160
    r = check_packed(qwen3.model, samples, pad_between_seqs=pad_between_seqs, pad_multiple=4, rows=2, pad_id=qwen3.pad)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert set(r.grads) == {"language", "vision"}
    assert r.within(TOL), r


@pytest.mark.parametrize("tamper", [_swap_slices, _one_grid])
def test_negative_controls_fail(qwen3, tamper):
    r = check_packed(qwen3.model, qwen3.samples, pad_multiple=4, rows=2, pad_id=qwen3.pad, tamper=tamper)
    assert not r.within(TOL) and r.worst > BUG, r


def test_deepstack_reaches_the_video_tokens(qwen3):
    """The packed run hands the video slices their deepstack maps (one per deepstack layer, one
    entry per slice): the same run with those maps zeroed gives other logits."""
    from sftpack.multimodal._family import text_kwargs

    fam, model = qwen3.fam, qwen3.model
    row = PackedBatch.from_samples(qwen3.samples[:3], pad_multiple=4, pad_id=qwen3.pad).validate()
    assert isinstance(row.media, PatchMedia) and row.media.num_videos == 2 + 3
    enc = fam.encoder_outputs(model, row.media)
    assert len(enc["video"].deepstack_features) == 2 and len(enc["video"].pooler_output) == row.media.num_videos
    hf = row.to_hf_kwargs()
    kw = text_kwargs(
        model, row, {"input_ids": hf["input_ids"], "position_ids": hf["position_ids"]}, pad_between_seqs=True
    )
    zeroed = dict(enc)
    zeroed["video"] = dataclasses.replace(
        enc["video"],
        deepstack_features=[tuple(torch.zeros_like(x) for x in f) for f in enc["video"].deepstack_features],
    )
    head = model.get_output_embeddings()
    with torch.no_grad():
        base = fam.packed_logits(model, row)
        same = head(model.model(**kw, mm_encoder_outputs=enc).last_hidden_state[0])
        moved = head(model.model(**kw, mm_encoder_outputs=zeroed).last_hidden_state[0])
    assert torch.equal(same, base)
    assert float((moved - same).abs().max()) > BUG


def test_a_video_split_between_its_slices_packs_exactly(qwen3):
    """An over-long sample is cut at text only: between a video's slices (at a timestamp), never
    inside a slice's block; each piece, alone on the model's own path, equals it in a packed row."""
    from sftpack.multimodal._tokenize import split_sample

    frames = next(s for s in qwen3.samples if s.conversation_id == "frames")
    pieces = split_sample(frames, 24, "split", qwen3.fam)
    assert len(pieces) >= 3 and sum(len(p) for p in pieces) == len(frames)
    split = [p.media.num_videos for p in pieces if p.media is not None]
    assert sum(split) == 3 and max(split) < 3  # the video's three slices are in more than one piece
    r = check_packed(qwen3.model, pieces, pad_multiple=4, rows=1, pad_id=qwen3.pad)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10 and r.within(TOL), r
