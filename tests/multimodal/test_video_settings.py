"""Video frames sized, sampled and normalised as a model folder's own video processor says.

A folder's ``video_preprocessor_config.json`` (else its ``preprocessor_config.json``, else
the class defaults) is read by :meth:`Qwen2VL.video_settings` when the family is made for the
folder (``family_for(folder)``, ``image_processor(folder)``), and :func:`encode_videos` sizes
the frames by it. References, all transformers' own code: ``smart_resize`` of
``Qwen2VLVideoProcessor``'s rule (the function its module copies from the PIL image processor's
module, which imports here) and of ``Qwen3VLVideoProcessor``'s (its module imports; the class
cannot run, its resize and normalisation need torchvision), both processors' own ``resize``
read from their source files with the last step (the torchvision resize) returning the size it
would resize to (so their per-frame caps too), ``Qwen3VLVideoProcessor`` itself for reading a
folder and its defaults, and its ``patchify`` for the layout. The
pixels of a frame are those of transformers' PIL image processor with the video settings
(``Qwen2VLImageProcessorPil``: its resize, rescale and normalisation), compared exactly.

Frames are tiny (60 x 100 to 96 x 128), folders hold a config and processor files only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen2_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_smart_resize

from sftpack.multimodal import BadImageError, UnsupportedModelError, family_for
from sftpack.multimodal._images import pixel_table
from sftpack.multimodal._video import VideoSampling, encode_videos, frame_size
from sftpack.multimodal.families.qwen2_vl import qwen2vl_image_processor as image_processor
from sftpack.multimodal.families.qwen3_vl import qwen3vl_image_processor
from tests.multimodal.conftest import noise_image


def _folder(root: Path, name: str, processor, video: dict | None = None) -> str:
    """A model folder of family ``name``: its config, ``processor``'s ``preprocessor_config.json``
    (none when ``processor`` is ``None``) and, when given, ``video`` as ``video_preprocessor_config.json``."""
    root.mkdir(parents=True, exist_ok=True)
    family_for(name).config(64, {}).save_pretrained(root)
    if processor is not None:
        processor.save_pretrained(root)
    if video is not None:
        (root / "video_preprocessor_config.json").write_text(json.dumps(video))
    return str(root)


def _clip(n: int, w: int, h: int, seed: int, *, still: bool = False) -> dict:
    frames = [noise_image(w, h, seed if still else seed * 100 + i) for i in range(n)]
    return {"type": "video", "frames": frames}


# ------------------------------------------------------------------ Qwen2-VL / Qwen2.5-VL: per frame
QWEN2_IMAGE = (56 * 56, 112 * 112)  # the folder's image processor limits
QWEN2_VIDEO = (112 * 168, 196 * 196)  # its video processor's: a 60 x 100 frame is sized up by them


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_the_folders_video_limits_size_each_frame(name, tmp_path):
    lo, hi = QWEN2_VIDEO
    folder = _folder(tmp_path, name, image_processor(*QWEN2_IMAGE), {"size": {"shortest_edge": lo, "longest_edge": hi}})
    fam = family_for(folder)
    proc = fam.image_processor(folder)
    assert (fam.video_sampling.min_pixels, fam.video_sampling.max_pixels) == (lo, hi)
    enc = fam.encode_videos([_clip(3, 100, 60, seed=1)], proc)
    h, w = qwen2_smart_resize(60, 100, factor=28, min_pixels=lo, max_pixels=hi)
    assert enc.grid_thw.tolist() == [[2, h // 14, w // 14]]  # 3 frames padded to 2 temporal slices
    # negative control: the image processor's limits give another grid (what a folder without video settings gets)
    h_img, w_img = qwen2_smart_resize(60, 100, factor=28, min_pixels=QWEN2_IMAGE[0], max_pixels=QWEN2_IMAGE[1])
    assert (h_img, w_img) != (h, w)
    assert encode_videos([_clip(3, 100, 60, seed=1)], proc).grid_thw.tolist() == [[2, h_img // 14, w_img // 14]]
    # the pixels: a still clip is patch for patch the PIL image processor's image with the video limits
    still = _clip(2, 100, 60, seed=2, still=True)
    ref = image_processor(lo, hi)(images=[still["frames"][0]], return_tensors="np")
    got = fam.encode_videos([still], proc)
    np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"])
    assert got.grid_thw.tolist() == ref["image_grid_thw"].tolist()


def test_the_folder_reaches_the_family_by_its_image_processor_too(tmp_path):
    lo, hi = QWEN2_VIDEO
    folder = _folder(
        tmp_path, "qwen2_vl", image_processor(*QWEN2_IMAGE), {"max_pixels": hi, "min_pixels": lo, "fps": 1.0}
    )
    fam = family_for("qwen2_vl")  # made by name, then given the folder's processor
    assert not fam.video_sampling.sized
    fam.image_processor(folder)
    assert fam.video_sampling == family_for(folder).video_sampling
    # min_pixels / max_pixels are Qwen2VLVideoProcessor's keys; fps without do_sample_frames: not sampled (its default)
    assert (fam.video_sampling.min_pixels, fam.video_sampling.max_pixels, fam.video_sampling.fps) == (lo, hi, None)


def _class_defaults(module: str, cls_name: str) -> dict:
    """The class-level settings of ``cls_name`` in transformers' source of ``module`` (evaluated as
    written; the module itself imports torchvision, which is not installed)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

    path = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    names = {
        "OPENAI_CLIP_MEAN": OPENAI_CLIP_MEAN,
        "OPENAI_CLIP_STD": OPENAI_CLIP_STD,
        "PILImageResampling": PILImageResampling,
    }
    out = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), path, "eval"), names)  # noqa: S307
            except NameError:  # a class reference (valid_kwargs)
                pass
    return out


def _settings_of(hf: dict) -> tuple:
    """What a video processor's settings (attributes or class defaults) say, in :class:`VideoSampling`'s terms."""
    size = hf["size"]
    fps = hf.get("fps") if hf["do_sample_frames"] else None
    return (
        size["shortest_edge"], size["longest_edge"], hf["patch_size"], hf["temporal_patch_size"], hf["merge_size"],
        tuple(float(x) for x in hf["image_mean"]), tuple(float(x) for x in hf["image_std"]),
        int(hf["resample"]), hf["min_frames"], hf["max_frames"], fps, hf["max_video_tokens"],
    )  # fmt: skip


def _ours(s: VideoSampling) -> tuple:
    return (
        s.min_pixels, s.max_pixels, s.patch_size, s.temporal_patch_size, s.merge_size, s.image_mean, s.image_std,
        s.resample, s.min_frames, s.max_frames, s.fps, s.max_video_tokens,
    )  # fmt: skip


def _qwen3_hf(**kw) -> dict:
    p = Qwen3VLVideoProcessor(**kw)
    return {k: getattr(p, k, None) for k in (*Qwen3VLVideoProcessor.valid_kwargs.__annotations__, "fps")}


def test_defaults_without_a_config(tmp_path):
    # no folder: HF's sampling defaults, each frame sized by the image processor (as the image is)
    assert family_for("qwen2_vl").video_sampling == VideoSampling()
    assert family_for("qwen3_vl").video_sampling == VideoSampling(fps=2.0, rule="qwen3_vl")
    # a folder with no processor file: the same
    bare = _folder(tmp_path / "bare", "qwen2_vl", None)
    assert family_for(bare).video_sampling == VideoSampling()
    # an empty video config: the video processor classes' own defaults, key by key
    q2 = family_for(_folder(tmp_path / "q2", "qwen2_vl", None, {})).video_sampling
    hf2 = _class_defaults("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor")
    assert _ours(q2) == _settings_of(hf2) and q2.rescale_factor == 1 / 255
    q3 = family_for(_folder(tmp_path / "q3", "qwen3_vl", None, {})).video_sampling
    assert _ours(q3) == _settings_of(_qwen3_hf())
    assert q3.image_mean == q3.image_std == (0.5, 0.5, 0.5) and q2.image_mean != q3.image_mean
    # a folder with only the image processor's file: its keys size the video (AutoVideoProcessor's
    # fallback), so a clip is sized as before, frame by frame by those limits
    only_image = _folder(tmp_path / "img", "qwen2_vl", image_processor(*QWEN2_IMAGE))
    fam = family_for(only_image)
    assert (fam.video_sampling.min_pixels, fam.video_sampling.max_pixels) == QWEN2_IMAGE
    proc = fam.image_processor(only_image)
    clip = _clip(3, 100, 60, seed=3)
    got = fam.encode_videos([clip], proc)
    plain = encode_videos([clip], proc)
    np.testing.assert_array_equal(got.pixel_values, plain.pixel_values)
    assert got.grid_thw.tolist() == plain.grid_thw.tolist()


# ------------------------------------------------------------------ Qwen3-VL: the whole clip
QWEN3_VIDEO = {
    "size": {"shortest_edge": 64 * 64, "longest_edge": 40000},
    "image_mean": [0.4, 0.45, 0.5],
    "image_std": [0.2, 0.25, 0.3],
    "fps": 1.0,
}


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory) -> str:
    proc = qwen3vl_image_processor(min_pixels=64 * 64, max_pixels=256 * 256)
    return _folder(tmp_path_factory.mktemp("qwen3"), "qwen3_vl", proc, QWEN3_VIDEO)


def test_qwen3_reads_the_folder_as_its_video_processor_does(qwen3_folder, tmp_path):
    ours = family_for(qwen3_folder).video_sampling
    hf = Qwen3VLVideoProcessor.from_pretrained(qwen3_folder)
    assert _ours(ours) == _settings_of({k: getattr(hf, k, None) for k in _qwen3_hf()})
    assert (ours.fps, ours.min_pixels, ours.image_std) == (1.0, 64 * 64, (0.2, 0.25, 0.3))
    # the fallback to the image processor's file, as from_pretrained falls back
    only_image = _folder(tmp_path, "qwen3_vl", qwen3vl_image_processor(min_pixels=32 * 32, max_pixels=96 * 96))
    hf = Qwen3VLVideoProcessor.from_pretrained(only_image)
    assert _ours(family_for(only_image).video_sampling) == _settings_of({k: getattr(hf, k, None) for k in _qwen3_hf()})


@pytest.mark.parametrize("frames", [2, 3, 6])
def test_qwen3_sizes_the_whole_clip_by_its_frame_count(qwen3_folder, frames):
    fam = family_for(qwen3_folder)
    proc = fam.image_processor(qwen3_folder)
    clip = _clip(frames, 128, 96, seed=frames)
    enc = fam.encode_videos([clip], proc)
    lo, hi = QWEN3_VIDEO["size"]["shortest_edge"], QWEN3_VIDEO["size"]["longest_edge"]
    h, w = qwen3_smart_resize(frames, 96, 128, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
    assert enc.grid_thw.tolist() == [[-(-frames // 2), h // 16, w // 16]]
    per_frame = qwen2_smart_resize(96, 128, factor=32, min_pixels=lo, max_pixels=hi)
    if frames == 6:  # the clip's budget shrinks its frames; each frame alone would have fitted
        assert (h, w) != per_frame and h * w < per_frame[0] * per_frame[1]
    # the patches: HF's layout over the frames resized (PIL bicubic) and normalised by the video's mean and std
    norm = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=QWEN3_VIDEO["image_mean"],
        image_std=QWEN3_VIDEO["image_std"],
    )  # fmt: skip
    chw = [np.moveaxis(np.asarray(f.resize((w, h), Image.BICUBIC)), -1, 0) for f in clip["frames"]]
    values = np.stack([norm.normalize(norm.rescale(x, 1 / 255), norm.image_mean, norm.image_std) for x in chw])
    want = Qwen3VLVideoProcessor.patchify(None, torch.from_numpy(values.astype(np.float32))[None], 16, 2, 2)[0][0]
    np.testing.assert_array_equal(enc.pixel_values, want.numpy())
    # negative control: the image processor's mean and std (0.5) give other values
    assert not np.array_equal(pixel_table(proc), pixel_table(norm))
    assert enc.tokens.tolist() == [h * w // 32**2] * (-(-frames // 2))  # one count per temporal slice


def _hf_resize_size(module: str, cls_name: str):
    """``cls_name.resize`` from transformers' source of ``module``, as written except its last
    statement (the torchvision resize, which cannot run here) returns the size it would resize
    to: ``f(self, videos, size, factor, temporal_factor, cap_pixels_per_frame) -> (h, w)``."""
    import math
    import types

    path = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "resize")
    assert isinstance(fn.body[-1], ast.Return)
    fn.body[-1] = ast.parse("return resized_height, resized_width").body[0]
    fn.decorator_list, fn.returns = [], None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    scope = {"math": math, "smart_resize": importlib.import_module(module.replace("video_processing_qwen2_vl",
             "image_processing_pil_qwen2_vl")).smart_resize}  # fmt: skip
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), path, "exec"), scope)

    def size_of(frames, h, w, lo, hi, factor, temporal, cap, tokens):
        from transformers.image_utils import SizeDict

        me = types.SimpleNamespace(max_video_tokens=tokens)
        videos = types.SimpleNamespace(shape=(1, frames, 3, h, w))
        size = SizeDict(shortest_edge=lo, longest_edge=hi)
        return scope["resize"](me, videos, size, None, factor, temporal_factor=temporal, cap_pixels_per_frame=cap)

    return size_of


@pytest.mark.parametrize(
    "rule, module, cls_name, factor",
    [
        ("qwen2_vl", "transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor", 28),
        ("qwen3_vl", "transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor", 32),
    ],
)
def test_frame_size_is_the_processors_resize(rule, module, cls_name, factor):
    """The size each processor's own ``resize`` picks, with and without its per-frame cap, over clips
    whose sides round, shrink and grow (and a side under one patch window, Qwen3-VL's upscale)."""
    hf = _hf_resize_size(module, cls_name)
    clips = [(2, 96, 128), (6, 96, 128), (8, 300, 200), (4, 40, 500), (3, 20, 90), (40, 60, 100), (2, 700, 500)]
    changed = 0
    for cap, tokens in [(False, 0), (True, 8), (True, 30), (True, 768)]:
        s = VideoSampling(
            rule=rule, min_pixels=1024, max_pixels=200000, cap_pixels_per_frame=cap, max_video_tokens=tokens
        )
        for frames, h, w in clips:
            want = hf(frames, h, w, 1024, 200000, factor, 2, cap, tokens)
            assert frame_size(frames, h, w, s, factor, 2) == want, (cap, tokens, frames, h, w)
            changed += want != hf(frames, h, w, 1024, 200000, factor, 2, False, 0)
    assert changed >= 3  # the cap reached: some clips sized otherwise than without it
    # negative control: the other rule sizes a many-frame clip otherwise
    other = "qwen2_vl" if rule == "qwen3_vl" else "qwen3_vl"
    s = VideoSampling(rule=other, min_pixels=1024, max_pixels=200000)
    assert frame_size(40, 60, 100, s, factor, 2) != hf(40, 60, 100, 1024, 200000, factor, 2, False, 0)


def test_qwen3_refuses_a_one_frame_clip_under_its_rule(qwen3_folder):
    fam = family_for(qwen3_folder)
    with pytest.raises(BadImageError, match="video_too_short") as e:
        fam.encode_videos([_clip(1, 128, 96, seed=9)], fam.image_processor(qwen3_folder), record=7, fields=["v"])
    assert "record 7, v:" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ bad settings
@pytest.mark.parametrize(
    "video, key",
    [
        ({"size": {"shortest_edge": -5, "longest_edge": 1000}}, "size.shortest_edge"),
        ({"size": {"longest_edge": 1000}}, "size.shortest_edge"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"size": 448}, "size"),
        ({"fps": "fast", "do_sample_frames": True}, "fps"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std"),
        ({"image_mean": [0.5, 0.5]}, "image_mean"),
        ({"do_normalize": False}, "do_normalize"),
        ({"min_frames": 10, "max_frames": 4}, "min_frames"),
        ({"do_sample_frames": True, "num_frames": 16}, "num_frames"),
        ({"resample": 9}, "resample"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_file_and_key(video, key, tmp_path):
    folder = _folder(tmp_path, "qwen2_vl", None, video)
    with pytest.raises(UnsupportedModelError) as e:
        family_for(folder)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(Path(folder) / "video_preprocessor_config.json") + ": ")
    assert f": {key} " in msg, msg


def test_an_unreadable_file_and_patch_sizes_not_the_models_are_refused(tmp_path):
    folder = _folder(tmp_path / "json", "qwen2_vl", None)
    (Path(folder) / "video_preprocessor_config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="video_preprocessor_config.json: cannot be read as JSON"):
        family_for(folder)
    folder = _folder(tmp_path / "patch", "qwen2_vl", image_processor(*QWEN2_IMAGE), {"patch_size": 16})
    fam = family_for(folder)
    proc = fam.image_processor(folder)
    want = r"video_preprocessor_config.json: patch_size.*\(16, 2, 2\) differ from the image processor's \(14, 2, 2\)"
    with pytest.raises(UnsupportedModelError, match=want):  # at setup, before any record
        fam.check(fam.tokenizer(), proc)
    with pytest.raises(UnsupportedModelError, match=want):
        fam.encode_videos([_clip(2, 100, 60, seed=4)], proc)
