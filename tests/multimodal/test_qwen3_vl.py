"""Qwen3-VL: its MRoPE positions are Hugging Face's, and a packed row equals each sample run alone on
Hugging Face's own ``Qwen3VLForConditionalGeneration`` (built from a config, tiny), in float64, also
from a user's model folder through ``sftpack verify`` and ``sftpack prepack``.

Qwen3-VL for images is Qwen2-VL's family with 16-px patches (its default image processor:
transformers' ``Qwen2VLImageProcessorPil`` with patch 16, temporal patch 2, merge 2, mean and std
0.5), interleaved MRoPE (inside the model: the positions are the same three rows) and deepstack
(the tower's maps from its blocks 0 and 1 added to the visual tokens' hidden states after text
layers 0 and 1). The samples: three conversations of random-noise images (wide, tall, two images
with text between, one image before any text), one text-only conversation and six easy-vqa
conversations (56 to 112 px), laid in three rows and run as one flat run.

Packed: the vision tower over the run's images (per-image boundaries), its merged output and
deepstack maps handed to the model, the language model over sftpack's varlen training attention
with the run's per-sample MRoPE positions, both boundary modes. Alone: each sample through Hugging
Face's own path (``get_rope_index``, its own vision tower and deepstack). Compared: logits of every
real token, the token-mean loss (one shared count of targets) and the gradient of every parameter.

Tolerance, fixed: 1e-10 in float64, the derivation of tests/multimodal/test_qwen2_5_vl.py (u =
2**-53 = 1.1e-16; an n-term sum in any order is off by at most n*u of its terms' magnitude sum,
Higham, Accuracy and Stability, section 3.1). The longest chain of roundings in one forward and
backward pass here is n <= 4,000: the patch embedding's 1,536-term dot products (3 x 2 x 16 x 16),
the 4-tap position-embedding interpolation, width 32 over 2 vision and 2 text layers, images of
<= 256 patches (the tower's attention sums; its weight gradients sum over <= 1,000 patches a row,
asserted), segments <= 160 tokens (asserted), <= 160 vocabulary ids (asserted). So each run is off
by <= 4.4e-13 relative, the two by <= 8.9e-13, on logits and gradients of magnitude <= 10
(asserted): <= 8.9e-12; 1e-10 is 11x that. The rotary angles are float32 from the integer
positions: identical positions give identical angles in both runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from sftpack import PackedBatch, Sample
from sftpack.cli import main
from sftpack.handoff.payload import PatchMedia
from sftpack.multimodal import UnsupportedModelError, check_packed, family_for, tokenize_media_conversations, vqa_corpus
from sftpack.multimodal._exactness import compare_packed_alone
from sftpack.multimodal.families.qwen2_vl import mrope_positions
from sftpack.multimodal.families.qwen3_vl import Qwen3VL
from sftpack.offline import PrepackedDataset
from tests.helpers import check_prepacked_rows, save_vlm_folder, write_folder_data
from tests.multimodal.conftest import Renumbered, assert_exact_with_tower, noise_conversations, positions_1d

TOL = 1e-10  # float64; see the docstring
# What a bug moves something by, at least: 1-D positions or a sample's deepstack maps on another
# image's tokens change logits of magnitude ~1 by far more than 1e-6 (observed: above 1e-3).
BUG = 1e-6


class _Renumbered(Renumbered):
    """:class:`Renumbered` that also keeps text-only samples (no media)."""

    def sample(self, s: Sample) -> Sample:
        if s.media is None or not s.media.num_items:
            return Sample(np.searchsorted(self.vocab, s.input_ids), s.loss_mask, s.conversation_id)
        return super().sample(s)


@pytest.fixture(scope="module")
def qwen3():
    fam = family_for("qwen3_vl")
    convs = [
        *noise_conversations({"wide": (256, 128), "two": (224, 192, 96, 64), "tall": (128, 256)}, text_only=True),
        *vqa_corpus(seed=2, limit=6, min_side=56, max_side=112),
    ]
    return _Renumbered(list(tokenize_media_conversations(convs, family=fam)), family="qwen3_vl")


@pytest.fixture(scope="module")
def model(qwen3):
    m = qwen3.model()
    assert type(m).__name__ == "Qwen3VLForConditionalGeneration" and m.dtype == torch.float64
    assert list(m.config.vision_config.deepstack_visual_indexes) == [0, 1] and m.config.vision_config.patch_size == 16
    assert family_for(m).name == "qwen3_vl"
    return m


def _rows(items):
    """Three consecutive rows, as ``check_packed(rows=3)`` cuts them."""
    k = -(-len(items) // 3)
    return [items[i : i + k] for i in range(0, len(items), k)]


def test_the_default_image_processor_is_qwen3_vls(qwen3):
    proc = family_for("qwen3_vl").image_processor()
    assert (proc.patch_size, proc.temporal_patch_size, proc.merge_size) == (16, 2, 2)
    assert list(proc.image_mean) == [0.5, 0.5, 0.5] and list(proc.image_std) == [0.5, 0.5, 0.5]
    grids = [tuple(g) for s in qwen3.samples if s.media is not None for g in s.media.grid_thw.tolist()]
    assert (1, 8, 16) in grids and (1, 16, 8) in grids and (1, 12, 14) in grids  # 256x128, 128x256, 224x192 px
    assert all(s.media.pixel_values.shape[1] == 3 * 2 * 16 * 16 for s in qwen3.samples if s.media is not None)
    # the embedded tokenizer names the ids Qwen3-VL's own config does
    fam = family_for("qwen3_vl")
    real = transformers.Qwen3VLConfig()
    assert fam.token_ids(fam.tokenizer()) == {k: getattr(real, k) for k in fam.token_ids(fam.tokenizer())}
    # Qwen2-VL's processor (patch 14) for a Qwen3-VL model: one line, before any record
    with pytest.raises(UnsupportedModelError, match=r"patch_size.*\(14, 2, 2\).*\(16, 2, 2\)"):
        family_for("qwen3_vl").check(family_for("qwen3_vl").tokenizer(), family_for("qwen2_vl").image_processor())


def test_positions_equal_hf_get_rope_index(qwen3, model):
    """Each sample's MRoPE positions (Qwen2-VL's rule) are ``Qwen3VLModel.get_rope_index``'s, also
    inside a packed row (restarting per sample); a rule that read the grids transposed would not be."""
    items = [s for s in qwen3.samples if s.media is not None]
    assert len(items) == len(qwen3.samples) - 1  # one text-only sample, left out here
    row = PackedBatch.from_samples(qwen3.samples, pad_id=qwen3.pad_id)
    cu = row.cu_seqlens.tolist()
    transposed_differs = 0
    for i, s in enumerate(qwen3.samples):
        if s.media is None:
            continue
        ids = torch.from_numpy(s.input_ids).unsqueeze(0)
        hf, _ = model.model.get_rope_index(
            ids, (ids == s.media.token_id).to(torch.int32), image_grid_thw=s.media.grid_thw
        )
        assert torch.equal(s.media.positions, hf[:, 0]), s.conversation_id
        assert torch.equal(row.media.positions[:, cu[i] : cu[i + 1]], hf[:, 0]), s.conversation_id
        grid = s.media.grid_thw.numpy()
        wrong = mrope_positions(len(s), s.media.slots.numpy(), grid[:, [0, 2, 1]], s.media.merge_size)
        transposed_differs += not np.array_equal(wrong, hf[:, 0].numpy())
    assert transposed_differs >= 3  # the wide, tall and two-image samples at least


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_packed_equals_alone(qwen3, model, pad_between_seqs, pad_multiple):
    items = qwen3.samples
    width = max(sum(-(-len(s) // pad_multiple) * pad_multiple for s in r) for r in _rows(items)) + 4 * pad_multiple
    rows = [PackedBatch.from_samples(r, pad_multiple=pad_multiple, row_width=width, pad_id=qwen3.pad_id)
            for r in _rows(items)]  # fmt: skip
    assert max(r.media.num_patches for r in rows) <= 1000 and max(len(s) for s in items) <= 160  # premises
    assert len(qwen3.vocab) <= 160 and any(s.media is None for s in items)
    assert max(int(g.prod()) for s in items if s.media is not None for g in s.media.grid_thw) <= 256
    assert_exact_with_tower(
        model,
        items,
        TOL,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=pad_multiple,
        row_width=width,
        pad_id=qwen3.pad_id,
    )


def test_positions_not_from_the_grids_fail(qwen3, model):
    r = check_packed(model, qwen3.samples, pad_id=qwen3.pad_id, rows=3, tamper=positions_1d)
    assert not r.within(TOL) and r.logits > BUG, r


class _DeepstackShifted(Qwen3VL):
    """The bug: each image's deepstack maps laid on the next image's tokens (the merged output right)."""

    def vision_outputs(self, model, media: PatchMedia):
        out = super().vision_outputs(model, media)
        out.deepstack_features = [(*f[1:], f[0]) for f in out.deepstack_features]
        return out


def test_deepstack_on_the_wrong_image_fails(qwen3, model):
    items = qwen3.samples[:4]  # wide, two (two images), text-only, tall: four images of other sizes
    batch = PackedBatch.from_samples(items, pad_id=qwen3.pad_id)
    fam, bad = family_for("qwen3_vl"), _DeepstackShifted()
    runs = {}
    for name, f in (("right", fam), ("shifted", bad)):
        runs[name] = compare_packed_alone(
            model,
            items,
            batch,
            alone=fam.alone_logits,
            packed=lambda f=f: f.packed_logits(model, batch),
            part_of=fam.part_of,
        )
    right, shifted = runs["right"], runs["shifted"]
    assert max(right[0], right[1], *right[2].values()) <= TOL, right
    assert shifted[0] > BUG and shifted[2]["vision"] > BUG, shifted


# ------------------------------------------------------------------ a user's folder


def _exact_lines(out: str) -> int:
    """Rows of ``sftpack verify``'s table that say ``exact`` (a path in one boundary mode)."""
    return sum(line.rstrip().endswith(" exact") for line in out.splitlines())


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The model-folder tests' four conversations (:func:`tests.helpers.write_folder_data`)."""
    return write_folder_data(tmp_path_factory.mktemp("vlm-data"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A user's Qwen3-VL folder (``save_pretrained`` of a model, a small tokenizer of its kind and
    its image processor, :func:`tests.helpers.save_vlm_folder`), the model 16 wide."""
    return save_vlm_folder(str(tmp_path_factory.mktemp("qwen3_vl")), "qwen3_vl", dim=16, heads=2, kv_heads=1)


def test_verify_passes_on_the_users_folder(folder, data, capsys):
    """The trainer's and the offline path (a prepack stored for patch 16, read back); the loader's
    builds its rows through the same family seam and is verified for the other families in
    tests/multimodal/test_model_folders.py (each path here costs ~3 s over the full vocabulary)."""
    args = ["verify", str(data), "--model", folder, "--max-seq-len", "256", "--limit", "4"]  # every conversation
    rc = main([*args, "--paths", "trainer", "offline"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(qwen3_vl, float64)" in out
    assert _exact_lines(out) == 4 and "not offered" not in out  # trainer and offline, both modes


def test_verify_of_the_tiny_family_needs_no_processor_by_hand(data, capsys):
    rc = main(["verify", str(data), "--family", "qwen3_vl", "--max-seq-len", "256", "--paths", "trainer"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "qwen3_vl" in out and _exact_lines(out) == 2


def test_prepacked_rows_of_the_folder_equal_each_sample_alone_through_hf(folder, data, tmp_path):
    out = tmp_path / "rows"
    assert main(["prepack", str(data), "--model", folder, "--out", str(out), "--max-seq-len", "256"]) == 0
    ds = PrepackedDataset(out)
    assert ds.manifest["media"]["family"] == "qwen3_vl" and ds.manifest["media"]["processor"]["patch_size"] == 16
    fam = family_for(folder)
    rows = [ds[i] for i in range(len(ds))]
    assert sum(len(r.sequence_ids) for r in rows) == 4 and max(len(r.sequence_ids) for r in rows) > 1
    check_prepacked_rows(fam, folder, data, rows)
