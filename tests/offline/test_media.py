"""Prepacks with images (``prepack(..., images=True)``): rows read back equal the rows built in
memory, byte for byte.

One small easy-vqa corpus (images 56-140 px a side, one or two per conversation) plus a
conversation whose image file is missing (counted, never packed) and one long enough to
be split at a text boundary, prepacked with a token and a patch budget. Checked: every
field of every row read back (its ``media`` too) against :meth:`PackedBatch.from_samples`
of the same samples tokenized in memory (``pixel_values`` byte-identical, from the stored uint8 pixels), the
same files for ``num_proc`` 1 and 2, a flipped media byte caught by the checksums, every
conversation accounted for, a prepack as the first format-3 writer wrote it (no family
named) still read, and one read row through a tiny float64 Qwen2-VL equal to
each of its samples run alone, in both boundary modes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")

from sftpack import PackedBatch, Sample  # noqa: E402
from sftpack.handoff.payload import PatchMedia  # noqa: E402
from sftpack.multimodal import (  # noqa: E402
    check_packed,
    family_for,
    load_image,
    tokenize_media_conversations,
    vqa_corpus,
)
from sftpack.multimodal._images import (  # noqa: E402
    _patchify_numpy,
    patchify_pixels,
    pixel_table,
    pixels_from_patches,
    resize_image,
)
from sftpack.offline import PrepackedDataset, PrepackError, prepack, prepack_samples  # noqa: E402
from sftpack.offline._format import MEDIA_FILES, seal_manifest  # noqa: E402
from sftpack.sample import IGNORE_INDEX  # noqa: E402

MAX_SEQ_LEN = 256
PAD_MULTIPLE = 4
MAX_PATCHES = 400
# Exactness tolerance, fixed, float64 (u = 2**-53 = 1.1e-16), as derived in
# tests/multimodal/test_exactness.py: packed and alone compute the same function and
# differ only in summation order; an n-term sum in any order is off by at most n*u of its
# terms' magnitude sum (Higham, section 3.1). The longest chain here is n <= 4,000 (the
# patch embedding's 1,176-term dot products, width 32 over 2 vision and 2 text layers,
# segments <= 256 tokens, <= 256 logits per row over <= 150 ids, <= 100 patches per image),
# so each run is off by <= 4.4e-13 relative, the two by <= 8.9e-13, on logits and gradients
# of magnitude <= 10 (asserted): <= 8.9e-12; 1e-10 is 11x that.
TOL = 1e-10
#: <|endoftext|> (the pad), <|vision_start|>, <|vision_end|>, <|image_pad|>, <|video_pad|>
PAD, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = SPECIAL_IDS = (151643, 151652, 151653, 151655, 151656)


class Renumbered:
    """Samples over a compact vocabulary (the ids they use, renumbered in sorted order, so the
    order and the special tokens' roles are kept), and a tiny float64 Qwen2-VL for it: a
    151,657-row embedding would make a float64 pass cost seconds instead of milliseconds."""

    def __init__(self, samples):
        self.vocab = np.unique(np.concatenate([s.input_ids for s in samples] + [np.array(SPECIAL_IDS)]))
        self.samples = [self.sample(s) for s in samples]

    def id(self, token_id):
        return int(np.searchsorted(self.vocab, token_id))

    def sample(self, s):
        # pixels stay float32: the float64 model's tower casts them, exactly
        media = dataclasses.replace(s.media, token_id=self.id(IMAGE_PAD))
        return Sample(np.searchsorted(self.vocab, s.input_ids), s.loss_mask, s.conversation_id, media=media)

    @property
    def pad_id(self):
        return self.id(PAD)

    def model(self, seed=0):
        ids = dict(
            image_token_id=self.id(IMAGE_PAD),
            vision_start_token_id=self.id(VISION_START),
            vision_end_token_id=self.id(VISION_END),
            video_token_id=self.id(VIDEO_PAD),
        )
        return family_for().tiny_model(vocab_size=len(self.vocab), token_ids=ids, seed=seed, dtype=torch.float64)


def _conversations(tmp_dir):
    convs = list(vqa_corpus(seed=2, limit=14, min_side=56, max_side=140))
    img = convs[0]["messages"][0]["content"][0]
    missing = {"type": "image", "path": str(tmp_dir / "no-such.png")}
    convs.insert(3, {"id": "bad-image", "messages": [
        {"role": "user", "content": [missing, {"type": "text", "text": "What shape?"}]},
        {"role": "assistant", "content": "A circle."},
    ]})  # fmt: skip
    long = [{"role": "user", "content": [dict(img), {"type": "text", "text": "Describe it."}]}]
    for k in range(24):
        long.append({"role": "assistant", "content": f"Answer number {k}: it is a shape with a colour."})
        long.append({"role": "user", "content": f"And question number {k + 1}, what else?"})
    long.append({"role": "assistant", "content": "That is all."})
    convs.insert(8, {"id": "long", "messages": long})
    return convs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _conversations(tmp_path_factory.mktemp("media-inputs"))


@pytest.fixture(scope="module")
def written(tmp_path_factory, corpus):
    """The corpus prepacked with num_proc 1 and 2: ``{1: path, 2: path}``."""
    family_for().tokenizer()  # loaded once, before the fork, so the workers inherit it
    out = {}
    for n in (1, 2):
        r = prepack(
            corpus,
            tmp_path_factory.mktemp("media") / f"p{n}",
            images=True,
            max_seq_len=MAX_SEQ_LEN,
            pad_multiple=PAD_MULTIPLE,
            max_patches_per_row=MAX_PATCHES,
            num_proc=n,
        )
        out[n] = r.path
    return out


@pytest.fixture(scope="module")
def in_memory(corpus):
    """The same conversations tokenized in memory (bad ones skipped), by conversation id and piece."""
    samples = tokenize_media_conversations(corpus, max_seq_len=MAX_SEQ_LEN, on_bad_row="skip")
    return {(s.conversation_id, int(s.meta.get("piece", 0)) if s.meta else 0): s for s in samples}


def _same_value(x, y, name):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, name
        assert x.numpy().tobytes() == y.numpy().tobytes(), name
    else:
        assert x == y, name


def _same(a, b):
    assert type(a) is type(b) is PackedBatch
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "media":
            assert type(x) is type(y) is PatchMedia and x.positions is not None
            for g in dataclasses.fields(x):
                _same_value(getattr(x, g.name), getattr(y, g.name), f"media.{g.name}")
            _same_value(x.vision_cu_seqlens, y.vision_cu_seqlens, "media.vision_cu_seqlens")
        else:
            _same_value(x, y, f.name)


def _row_samples(ds, r, in_memory):
    seqs = ds.row_sequences(r)
    return [in_memory[(ds.conversation_id(int(c)), int(k))] for c, k in zip(seqs["conversation"], seqs["piece"])]


def test_rows_read_back_equal_rows_built_in_memory(written, in_memory):
    ds = PrepackedDataset(written[1], verify="full", expect={"max_seq_len": MAX_SEQ_LEN, "pad_multiple": PAD_MULTIPLE})
    assert ds.media is not None and len(ds) >= 3
    seen = 0
    for r in range(len(ds)):
        row = ds[r].validate()
        samples = _row_samples(ds, r, in_memory)
        built = PackedBatch.from_samples(samples, max_seq_len=MAX_SEQ_LEN, pad_multiple=PAD_MULTIPLE, pad_id=PAD)
        _same(row, built)
        assert row.num_tokens == MAX_SEQ_LEN and int(row.media.grid_thw.prod(dim=1).sum()) <= MAX_PATCHES
        imgs = ds.row_images(r)
        assert [tuple(x.shape) for x in imgs] == [(14 * h, 14 * w, 3) for _, h, w in row.media.grid_thw.tolist()]
        seen += len(samples)
    assert seen == len(in_memory) == ds.manifest["counts"]["sequences"]
    # several rows at once: the rows laid end to end, and what a DataLoader's batched fetch collates
    _same(ds.batch([2, 0, 1]), PackedBatch.concat([ds[2], ds[0], ds[1]]))
    fetched = ds.__getitems__([1, 2])
    _same(ds.collate(fetched), PackedBatch.concat([ds[1], ds[2]]))
    _same(fetched[1], ds[2])


def _built(ds, r, in_memory):
    """Row ``r`` built in memory from its samples (the reference every read is held to)."""
    samples = _row_samples(ds, r, in_memory)
    return PackedBatch.from_samples(samples, max_seq_len=MAX_SEQ_LEN, pad_multiple=PAD_MULTIPLE, pad_id=PAD)


def _equal(a, b):
    try:
        _same(a, b)
    except AssertionError:
        return False
    return True


def test_rows_with_images_read_in_batches_equal_the_rows_built_in_memory_laid_end_to_end(written, in_memory):
    """read_rows lays any rows (out of order, repeated, the whole prepack) in one pass, their media
    and the patches of all their images into one buffer: byte for byte the in-memory rows concatenated.
    Negative control: the same rows in another order are not equal."""
    ds = PrepackedDataset(written[1])
    n = ds.num_rows
    built = [_built(ds, r, in_memory) for r in range(n)]
    for rows in ([2, 0, 1], [n - 1, 0, n - 1], list(range(n)), [1]):
        got = ds.read_rows(rows)
        assert got.media.num_items == sum(built[r].media.num_items for r in rows)
        _same(got, PackedBatch.concat([built[r] for r in rows]))
    assert not _equal(ds.read_rows([0, 1]), PackedBatch.concat([built[1], built[0]]))
    with pytest.raises(IndexError, match="out of range"):
        ds.read_rows([n])


def test_a_dataloader_reads_rows_with_images_in_one_pass_and_cuts_each_row_with_its_media(written, in_memory):
    """A DataLoader with a batch_size fetches through __getitems__ (one read_rows); ds.collate hands
    the batch on; a collate_fn that iterates gets each row with its own media (items, runs, segments
    and positions counted from the row's start), equal to the row built in memory."""
    ds = PrepackedDataset(written[1])
    built = [_built(ds, r, in_memory) for r in range(ds.num_rows)]
    order = list(range(ds.num_rows))
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=ds.collate)
    for k, batch in enumerate(loader):
        _same(batch, PackedBatch.concat([built[r] for r in order[2 * k : 2 * k + 2]]))
    rows = list(torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=list))
    flat = [row for batch in rows for row in batch]
    assert len(flat) == ds.num_rows
    for r, row in enumerate(flat):
        _same(row, built[r])
        row.validate()
    assert not _equal(flat[0], built[1])


def test_a_damaged_media_index_opened_without_checks_is_named_on_read(written, tmp_path):
    """verify=None (a DataLoader worker re-opening what its parent checked) skips the index checks;
    an image's placeholder start moved out of its sequence then fails the read with the path and the fix."""
    copy = tmp_path / "copy"
    shutil.copytree(written[1], copy)
    images = np.load(copy / "images.npy")
    r = next(r for r in range(PrepackedDataset(copy).num_rows) if PrepackedDataset(copy)[r].media.num_items)
    k = int(np.load(copy / "row_images.npy")[r])
    images["start"][k] += 5  # its run no longer on the placeholders
    np.save(copy / "images.npy", images)
    with pytest.raises(PrepackError, match="images.npy"):
        PrepackedDataset(copy)  # the default checks find it
    ds = PrepackedDataset(copy, verify=None)
    with pytest.raises(PrepackError, match=f"{re.escape(str(copy))}: row {r} cannot be read with its images"):
        ds.read_rows([r])


def test_files_are_byte_identical_for_any_num_proc(written):
    a, b = written[1], written[2]
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and set(MEDIA_FILES) <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_every_conversation_is_accounted_for(written, corpus, in_memory):
    m = json.loads((written[1] / "manifest.json").read_text())
    c = m["counts"]
    assert c["read"] == len(corpus) and c["read"] == c["kept"] + sum(c["dropped"].values())
    assert c["dropped"] == {"image_missing_file": 1}
    oc = c["overlong"]
    assert oc["split"] == 1 and oc["tokenized"] == oc["fit"] + oc["split"] + oc["dropped"] + oc["truncated"]
    assert c["packed_conversations"] == c["kept"] and c["sequences"] == len(in_memory) > c["kept"]
    assert c["tokens"] == sum(len(s) for s in in_memory.values())
    media = m["media"]
    assert media["images"] == sum(s.media.num_items for s in in_memory.values())
    assert media["patches"] == sum(s.num_patches for s in in_memory.values())
    # the stored pixels are 3 bytes a pixel; the float32 patches would be 24 (8x)
    assert media["pixel_bytes"] * 8 == sum(s.media.pixel_values.numpy().nbytes for s in in_memory.values())
    assert m["format_version"] == 4 and m["fingerprint"]["media"]["kind"] == media["kind"]
    assert media["family"] == m["fingerprint"]["media"]["family"] == "qwen2_vl"
    assert m["fingerprint"]["max_patches_per_row"] == MAX_PATCHES and m["source"] == "multimodal conversations"


def _flip(path, offset_from_end=1):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, mode", [("pixels.npy", "full"), ("images.npy", "size"), ("row_images.npy", "size")])
def test_a_flipped_media_byte_is_caught(written, tmp_path, name, mode):
    copy = tmp_path / "copy"
    shutil.copytree(written[1], copy)
    PrepackedDataset(copy, verify=mode)  # intact: opens
    _flip(copy / name, 3)
    with pytest.raises(PrepackError, match=name):
        PrepackedDataset(copy, verify=mode)


def test_an_edited_media_entry_is_refused(written, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(written[1], copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["media"]["processor"]["image_mean"][0] = 0.5
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PrepackError, match="manifest_sha256"):
        PrepackedDataset(copy)


def test_patchify_on_read_is_the_processors_output_byte_for_byte(corpus):
    """The stored form (the processor's resize, uint8) patchified with the processor's own
    rescale/normalise table gives its pixel_values bit for bit, on every image of the corpus
    (sizes 56-140 px, aspect ratios from 0.4 to 2.5) and two large ones; the inverse recovers
    the pixels exactly and refuses patches that no uint8 image gives."""
    proc = family_for().image_processor()
    table = pixel_table(proc)
    assert table.dtype == np.float32 and np.all(np.diff(table, axis=1) > 0)  # injective: the inverse exists
    parts = [p for c in corpus for m in c["messages"] if isinstance(m["content"], list) for p in m["content"]]
    parts = [p for p in parts if p["type"] == "image" and "no-such" not in str(p.get("path"))]
    parts += [dict(parts[0], resize=[448, 448]), dict(parts[1], resize=[500, 90])]
    for part in parts:
        img = load_image(part)
        want = proc(images=[img], return_tensors="np")
        pv = np.ascontiguousarray(want["pixel_values"], dtype=np.float32)
        px = resize_image(img, proc)
        assert px.dtype == np.uint8 and px.shape[2] == 3
        assert patchify_pixels(px, proc).tobytes() == pv.tobytes()  # the compiled kernel
        ref = np.empty_like(pv)
        _patchify_numpy(px, table, 14, 2, 2, ref)  # the numpy stand-in, used without numba
        assert ref.tobytes() == pv.tobytes()
        grid = want["image_grid_thw"][0]
        assert np.array_equal(pixels_from_patches(pv, grid, proc), px)
    bad = pv.copy()
    bad[0, [0, 14 * 14]] = np.nextafter(bad[0, 0], np.float32(10))  # channel 0's first pixel, both temporal copies
    with pytest.raises(ValueError, match="no uint8 pixel"):
        pixels_from_patches(bad, grid, proc)
    bad[0, 0] = pv[0, 0]
    with pytest.raises(ValueError, match="temporal copies differ"):
        pixels_from_patches(bad, grid, proc)


def _renumber_row(rn: Renumbered, row: PackedBatch) -> PackedBatch:
    """A read row over the compact vocabulary of the tiny model (its float32 patches: the float64
    tower casts them, exactly)."""
    labels = row.labels.clone()
    keep = labels != IGNORE_INDEX
    labels[keep] = torch.from_numpy(np.searchsorted(rn.vocab, labels[keep].numpy()))
    return dataclasses.replace(
        row,
        input_ids=torch.from_numpy(np.searchsorted(rn.vocab, row.input_ids.numpy())),
        labels=labels,
        media=dataclasses.replace(row.media, token_id=rn.id(IMAGE_PAD)),
    )


@pytest.fixture(scope="module")
def exact_row(written, in_memory):
    ds = PrepackedDataset(written[1])
    r = max(range(len(ds)), key=lambda i: (ds[i].num_media_items, ds[i].num_sequences))
    row = ds[r]
    rn = Renumbered(_row_samples(ds, r, in_memory))
    torch.set_num_threads(1)
    return rn, _renumber_row(rn, row), rn.model()


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_a_read_row_through_qwen2vl_equals_each_sample_alone(exact_row, pad_between_seqs):
    """The row as read from disk (check_packed's own row swapped for it) against each in-memory
    sample run alone: logits, loss, gradients of the language model and the vision tower."""
    rn, row, model = exact_row
    assert row.num_sequences >= 3 and row.num_media_items >= 3 and int(row.cu_seqlens_padded[-1]) == MAX_SEQ_LEN
    r = check_packed(
        model,
        rn.samples,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=PAD_MULTIPLE,
        row_width=MAX_SEQ_LEN,
        pad_id=rn.pad_id,
        tamper=lambda built: row,
    )
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert r.within(TOL), r
    # the control: the same row with 1-D positions in the MRoPE rows (the grids ignored) fails by
    # far more (tests/multimodal/test_exactness.py's BUG, 1e6 x TOL)
    one_d = dataclasses.replace(
        row, media=dataclasses.replace(row.media, positions=row.position_ids.expand(3, -1).clone())
    )
    bad = check_packed(
        model,
        rn.samples,
        pad_between_seqs=pad_between_seqs,
        pad_multiple=PAD_MULTIPLE,
        row_width=MAX_SEQ_LEN,
        pad_id=rn.pad_id,
        tamper=lambda built: one_d,
    )
    assert not bad.within(1e-4), bad


def test_the_cli_prepacks_the_vqa_corpus_and_inspect_shows_the_images(tmp_path, capsys):
    from sftpack.cli import main

    out = tmp_path / "vqa.prepack"
    args = ["prepack", "--corpus", "vqa", "--limit", "6", "--out", str(out), "--max-seq-len", "2048"]
    assert main([*args, "--max-patches-per-row", "2500", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert re.search(
        r"images\s+\d+ media items \([\d.]+ a row\), [\d,]+ vision patches; stored as resized uint8 pixels", text
    )
    ds = PrepackedDataset(out, verify="full")
    assert ds.manifest["counts"]["read"] == 6 and ds.manifest["fingerprint"]["corpus"]["name"] == "easy-vqa"
    assert all(int(ds[i].media.grid_thw.prod(dim=1).sum()) <= 2500 for i in range(len(ds)))
    assert main(["inspect", str(out), "--row", "0"]) == 0
    shown = capsys.readouterr().out
    assert "stored as resized uint8 pixels" in shown and re.search(r"media image \d+x\d+ px at slot \d+", shown)
    assert main(["prepack", "--corpus", "vqa", "--out", str(tmp_path / "x"), "--tokenizer", "somewhere"]) == 2
    assert "--tokenizer: not offered with --corpus vqa" in capsys.readouterr().err


def test_a_bad_image_in_error_mode_names_the_record_and_field_and_leaves_nothing(corpus, tmp_path):
    from sftpack.multimodal import BadImageError

    out = tmp_path / "never"
    with pytest.raises(BadImageError, match=r"'bad-image', messages\[0\]\.content\[0\]\.path: no file"):
        prepack(corpus[:5], out, images=True, max_seq_len=MAX_SEQ_LEN, on_bad_row="error")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_prepack_of_the_format_before_videos_is_refused_with_the_fix(written, tmp_path):
    """Format 3 (images only, 40-byte records without frames, video and seconds) is not read: one
    line saying so and how to write it again, not a misread pixel file."""
    copy = tmp_path / "format-3"
    shutil.copytree(written[1], copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["format_version"] = 3
    (copy / "manifest.json").write_text(json.dumps(seal_manifest(m)))
    with pytest.raises(PrepackError, match=r"format version 3.*no longer reads: write it again.*--overwrite"):
        PrepackedDataset(copy)


def test_the_options_of_images_are_checked_before_anything_is_read(corpus, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="max_patches_per_row is a budget for images"):
        prepack(corpus, out, max_patches_per_row=10)
    with pytest.raises(ValueError, match="overlong='truncate' is not offered with images"):
        prepack(corpus, out, images=True, overlong="truncate")
    with pytest.raises(ValueError, match="train_on='last_assistant' is not offered with images"):
        prepack(corpus, out, images=True, train_on="last_assistant")
    with pytest.raises(ValueError, match="'mistral3'.* is not a vision-language family"):
        prepack(corpus, out, images=True, family="mistral3")
    with pytest.raises(ValueError, match="takes an iterable of conversations, got paths"):
        prepack(str(tmp_path / "inputs"), out, images=True)
    assert not out.exists()


def test_a_sample_with_media_is_never_written_without_its_images(in_memory, tmp_path):
    s = next(s for s in in_memory.values() if s.media is not None)
    with pytest.raises(ValueError, match="carries media, which a text prepack would lose"):
        prepack_samples([s], tmp_path / "never", max_seq_len=MAX_SEQ_LEN)
    assert not (tmp_path / "never").exists()
