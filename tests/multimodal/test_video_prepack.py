"""Videos in a prepack, for the Qwen-VL families: ``sftpack prepack --model DIR`` stores each
video item's resized uint8 frames (a Qwen3-VL video one item per temporal slice) with its grid
and seconds per slice, and the rows read back, through the folder's own Hugging Face class
(float64), equal each sample alone; ``sftpack verify`` on a folder with video data passes on the
offline path. The data mixes a video given as frames, a short clip encoded here (PyAV), an image,
an image with a video, and text only.

Tolerance and negative control: tests/multimodal/test_model_folders.py's (1e-10 in float64,
derived there; positions not restarted move the logits by more than 1e-6), through its
:func:`check_prepacked_rows`. A row's stored frames are also compared with the in-memory
sample's values, bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from sftpack.cli import main
from sftpack.multimodal import family_for
from sftpack.offline import PrepackedDataset
from tests.helpers import check_prepacked_rows, folder_samples, save_vlm_folder
from tests.multimodal.conftest import noise_image
from tests.multimodal.test_video import _write_clip

pytest.importorskip("av")


def _conv(*parts: dict, answer: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": answer},
        ]
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-data")
    names = []
    for k in range(3):  # an odd count: padded to whole temporal slices by repeating the last
        noise_image(56, 56, 40 + k).save(root / f"f{k}.png")
        names.append(f"f{k}.png")
    noise_image(56, 84, 7).save(root / "still.png")
    _write_clip(str(root / "clip.mp4"), 8)
    rows = [
        _conv({"type": "video", "frames": names, "fps": 2.0}, answer="It flickers."),
        _conv({"type": "image", "path": "still.png"}, answer="Noise."),
        _conv({"type": "video", "path": "clip.mp4", "fps": 2.0}, answer="It fades."),
        {"messages": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]},
        _conv(
            {"type": "image", "path": "still.png"}, {"type": "video", "path": "clip.mp4", "fps": 1.0}, answer="Both."
        ),
    ]
    path = root / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])  # Qwen2-VL's: verify below
def test_prepacked_video_rows_equal_each_sample_alone_through_hf(name, data, tmp_path, tmp_path_factory, capsys):
    root = str(tmp_path_factory.mktemp(f"{name}-video"))
    sizes = (
        {"dim": 16, "heads": 2, "kv_heads": 1} if name == "qwen3_vl" else {}
    )  # as tests/multimodal/test_qwen3_vl.py's
    path = save_vlm_folder(root, name, **sizes)
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", path, "--out", str(out), "--max-seq-len", "512"]) == 0
    ds = PrepackedDataset(out)
    media = ds.manifest["media"]
    assert media["family"] == name and ds.manifest["counts"]["dropped"] == {}
    records = np.load(out / "images.npy")
    fam = family_for(path)
    samples = {s.conversation_id: s for s in folder_samples(fam, path, data)}
    in_memory = [s.media for s in samples.values() if s.media is not None]
    # every item stored: 2 images and 3 videos (Qwen3-VL: one item per temporal slice), each video
    # item with its frames (temporal patch 2 per slice), an image with one
    assert int((records["video"] == 0).sum()) == 2
    assert int(records["video"].sum()) == sum(m.num_videos for m in in_memory) >= 3
    assert records["frames"].tolist() == np.where(records["video"] == 1, 2 * records["grid_t"], 1).tolist()
    rows = [ds[i] for i in range(len(ds))]
    assert sum(len(r.sequence_ids) for r in rows) == 5 and max(len(r.sequence_ids) for r in rows) > 1
    for row in rows:  # the stored frames give back the in-memory values, bit for bit
        alone = [samples[i].media for i in row.sequence_ids if samples[i].media is not None]
        want = torch.cat([m.pixel_values for m in alone]) if alone else row.media.pixel_values[:0]
        assert torch.equal(row.media.pixel_values, want)
        assert torch.equal(row.media.video, torch.cat([m.video for m in alone]) if alone else row.media.video)
    check_prepacked_rows(fam, path, data, rows)
    assert all(main(["inspect", str(out), "--row", str(r)]) == 0 for r in range(len(ds)))
    shown = capsys.readouterr().out
    assert re.search(r"media video \d+ frames of \d+x\d+ px at slot \d+ \(\d+ placeholders, [\d.]+ s a slice\)", shown)


def test_verify_takes_video_data_on_the_offline_path(data, tmp_path_factory, capsys):
    """Qwen2-VL's folder (Qwen2.5-VL's and Qwen3-VL's rows are checked above, the same way)."""
    path = save_vlm_folder(str(tmp_path_factory.mktemp("qwen2_vl-verify")), "qwen2_vl")
    rc = main(["verify", str(data), "--model", path, "--max-seq-len", "512", "--paths", "offline", "--limit", "5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [line for line in out.splitlines() if line.startswith("offline ")]
    assert len(table) == 2 and all(line.rstrip().endswith(" exact") for line in table), out


def test_videos_normalised_by_the_folders_video_settings_are_stored_exactly(data, tmp_path, tmp_path_factory):
    """A folder whose video processor normalises otherwise than its image processor (its own mean
    and std): the prepack stores the frames and remakes the videos' values by the video settings
    (kept in the manifest), the images' by the image processor, both bit for bit."""
    root = str(tmp_path_factory.mktemp("qwen2_vl-video-settings"))
    path = save_vlm_folder(root, "qwen2_vl")
    video = {
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.25, 0.5, 0.75],
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
    }
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(video))
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", path, "--out", str(out), "--max-seq-len", "512"]) == 0
    ds = PrepackedDataset(out)
    media = ds.manifest["media"]
    assert media["video_processor"]["image_std"] == [0.25, 0.5, 0.75] != media["processor"]["image_std"]
    fam = family_for(path)
    samples = {s.conversation_id: s for s in folder_samples(fam, path, data)}
    seen = 0
    for i in range(len(ds)):
        row = ds[i]
        alone = [samples[c].media for c in row.sequence_ids if samples[c].media is not None]
        if alone:
            assert torch.equal(row.media.pixel_values, torch.cat([m.pixel_values for m in alone]))
            seen += int(row.media.video.sum())
    assert seen >= 3
