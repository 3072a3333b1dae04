"""Megatron-Energon end to end with images: a real WebDataset shard of easy-vqa conversations (PNG and
JPEG files beside each conversation's JSON), prepared with Energon's own preparation, packed by
PackingTaskEncoder (the one encoder, for samples with and without images). The rows are the loader's
planner's rows (under the patch budget) for Energon's buffers, bit for bit;
one of them, run through a tiny float64 Qwen2-VL, equals each of its samples run alone; save/restore
gives the remaining rows exactly (0 and 2 workers); restore_sample rebuilds a row from its key;
every sample is in a row or counted as dropped."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.energon")
pytest.importorskip("easy_vqa")

from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, reraise_exception  # noqa: E402
from megatron.energon.epathlib import EPath  # noqa: E402
from megatron.energon.flavors import BaseWebdatasetFactory  # noqa: E402

from sftpack import PackedBatch  # noqa: E402
from sftpack.handoff import pack_rows  # noqa: E402
from sftpack.loader import PackingDataset  # noqa: E402
from sftpack.loader.energon import EnergonPackedBatch, PackingTaskEncoder, TokenizedSample  # noqa: E402
from sftpack.multimodal import (  # noqa: E402
    BadImageError,
    check_packed,
    load_image,
    tokenize_media_conversation,
    vqa_corpus,
)
from sftpack.sample import IGNORE_INDEX, OverlongError  # noqa: E402
from tests.multimodal.conftest import Renumbered  # noqa: E402
from tests.multimodal.test_exactness import BUG, TOL, _media_reversed  # noqa: E402

# 24 conversations (7 with two images), images 56-112 px a side: 4-16 placeholders, 16-64 patches each.
N, BUFFER, WIDTH, MULT, PATCHES = 24, 8, 256, 4, 240


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tf.addfile(info, io.BytesIO(data))


def _write_shard(path, convs, damage=None) -> dict:
    """A WebDataset shard: KEY.json plus KEY.imgN.png / .jpg (alternating), each image resized to its seeded
    size and encoded; the JSON's image parts name the files. Returns, per id, the conversation with the
    same bytes inline (the reference). ``damage``: {sample index: file bytes to store instead, or None to
    leave the file out}."""
    damage = damage or {}
    refs = {}
    with tarfile.open(path, "w") as tf:
        for k, conv in enumerate(convs):
            key, n, stored, inline = f"{k:06d}", 0, [], []
            for msg in conv["messages"]:
                parts, parts_inline = [], []
                for part in msg["content"]:
                    if part["type"] != "image":
                        parts.append(part)
                        parts_inline.append(part)
                        continue
                    fmt, ext = ("PNG", "png") if n % 2 == 0 else ("JPEG", "jpg")
                    buf = io.BytesIO()
                    load_image(part).save(buf, fmt)
                    name, data = f"img{n}.{ext}", buf.getvalue()
                    if n == 0 and k in damage:
                        data = damage[k]
                    if data is not None:
                        _add(tf, f"{key}.{name}", data)
                    parts.append({"type": "image", "path": name})
                    parts_inline.append({"type": "image", "bytes": data})
                    n += 1
                stored.append({**msg, "content": parts})
                inline.append({**msg, "content": parts_inline})
            _add(tf, f"{key}.json", json.dumps({"id": conv["id"], "messages": stored}).encode())
            refs[conv["id"]] = inline
    return refs


def _prepare(root, convs, damage=None) -> dict:
    """``energon prepare`` of one shard as a CrudeWebdataset (its Python call, as the CLI makes it)."""
    root.mkdir()
    refs = _write_shard(root / "shard-0.tar", convs, damage)
    BaseWebdatasetFactory.prepare_dataset(
        EPath(str(root)), ["shard-0.tar"], split_parts_ratio=[("train", 1.0)], workers=1, shuffle_seed=None
    )
    (root / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    return refs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    convs = list(vqa_corpus(seed=2, limit=N, min_side=56, max_side=112))
    root = tmp_path_factory.mktemp("energon_media") / "vqa"
    refs = _prepare(root, convs)
    samples = {cid: tokenize_media_conversation(msgs, conversation_id=cid)[0] for cid, msgs in refs.items()}
    return str(root), convs, samples


def _loader(path, num_workers, batch_size=1, **kw):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, global_error_handler=reraise_exception)
    enc = PackingTaskEncoder(
        **{
            "max_seq_len": WIDTH,
            "max_patches_per_row": PATCHES,
            "pad_multiple": MULT,
            "pad_id": _QWEN2VL_PAD,
            **kw,
        },
    )
    ds = get_train_dataset(
        path,
        worker_config=wc,
        batch_size=batch_size,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=enc,
        repeat=False,
    )
    return get_savable_loader(ds)


_MEDIA = ("positions", "pixel_values", "grid_thw", "vision_cu_seqlens", "slots", "sequence")
_QWEN2VL_PAD = 151643  # <|endoftext|>: the pad_id these tests give the encoder


def sig(b: PackedBatch) -> tuple:
    """Every field of a batch and of its media, bytes for tensors (dtype included)."""
    out = []
    fields = [(b, f) for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded")]
    for owner, f in fields + [(b.media, f) for f in _MEDIA]:
        t = getattr(owner, f)
        out.append((f, str(t.dtype), tuple(t.shape), t.numpy().tobytes()))
    return (*out, b.max_seqlen, tuple(b.sequence_ids), b.media.token_id, b.media.merge_size)


def _run(path, num_workers, k):
    """All batches, and the state saved after batch k (the run goes on to the end: no slow teardown)."""
    loader, batches, state = _loader(path, num_workers), [], None
    for i, b in enumerate(loader):
        batches.append(b)
        if i + 1 == k:
            state = loader.save_state_rank()
    return loader, batches, state


@pytest.fixture(scope="module")
def runs(prepared):
    path = prepared[0]
    return {nw: _run(path, nw, k=3) for nw in (0, 2)}


def test_rows_are_the_planners_rows_with_media_in_row_order(prepared, runs):
    """0 workers: Energon's buffers are the dataset in order, BUFFER at a time; each row is
    PackedBatch.from_samples of the samples the loader's planner put together (best-fit decreasing
    under both budgets), every field bit for bit."""
    _, convs, samples = prepared
    _, batches, _ = runs[0]
    ids = [c["id"] for c in convs]
    want = []
    for a in range(0, N, BUFFER):
        chunk = [samples[i] for i in ids[a : a + BUFFER]]
        for row in pack_rows(
            np.array([len(s) for s in chunk]),
            max_seq_len=WIDTH,
            pad_multiple=MULT,
            algorithm="bfd",
            patches=np.array([s.num_patches for s in chunk]),
            max_patches_per_row=PATCHES,
        ):
            want.append(
                PackedBatch.from_samples(
                    [chunk[i] for i in row], max_seq_len=WIDTH, pad_multiple=MULT, pad_id=_QWEN2VL_PAD
                )
            )
    assert [sig(b.validate()) for b in batches] == [sig(w) for w in want]
    # The loader path's rule with max_wait=0 (each buffer packed whole) lays the same rows.
    ours = PackingDataset(
        [samples[i] for i in ids],
        max_seq_len=WIDTH,
        buffer_size=BUFFER,
        max_patches_per_row=PATCHES,
        pad_multiple=MULT,
        max_wait=0,
        pad_id=_QWEN2VL_PAD,
    )
    assert [sig(r) for r in ours] == [sig(w) for w in want]
    assert sorted(i for b in batches for i in b.sequence_ids) == sorted(ids)  # each sample exactly once
    images = sum(s.media.num_items for s in samples.values())
    assert sum(b.num_media_items for b in batches) == images == 31  # 7 with two
    for b in batches:
        assert isinstance(b, EnergonPackedBatch) and b.dropped == ()
        m = b.media
        assert b.num_tokens == WIDTH and int(m.pixel_values.shape[0]) <= PATCHES  # both budgets hold
        # Media in row order: the samples' patches in sequence_ids order, each image's run at its slot.
        mine = [samples[i] for i in b.sequence_ids]
        assert torch.equal(m.pixel_values, torch.cat([s.media.pixel_values for s in mine]))
        assert m.sequence.tolist() == [j for j, s in enumerate(mine) for _ in range(s.media.num_items)]
        starts = [int(b.cu_seqlens_padded[j]) + r for j, s in enumerate(mine) for r in s.media.slots[:, 0].tolist()]
        assert m.slots[:, 0].tolist() == starts == sorted(starts)
        for (s0, n), _ in zip(m.slots.tolist(), range(b.num_media_items)):
            assert bool((b.input_ids[s0 : s0 + n] == m.token_id).all())
    assert len(batches) < N / 2  # packed: fewer rows than half the samples


def _renumber(b: PackedBatch, rn: Renumbered) -> PackedBatch:
    """A row over the compact vocabulary (and float64 patches) of the tiny model."""
    ids = torch.from_numpy(np.searchsorted(rn.vocab, b.input_ids.numpy()))
    lab = b.labels.numpy()
    labels = torch.from_numpy(np.where(lab == IGNORE_INDEX, IGNORE_INDEX, np.searchsorted(rn.vocab, lab)))
    base = {f.name: getattr(b, f.name) for f in dataclasses.fields(PackedBatch)}
    media = dataclasses.replace(b.media, pixel_values=b.media.pixel_values.double(), token_id=rn.id(b.media.token_id))
    return PackedBatch(**{**base, "input_ids": ids, "labels": labels, "media": media})


def test_a_packed_row_equals_each_sample_alone(prepared, runs):
    """The fullest row (most samples) through a tiny float64 Qwen2-VL: its logits at each sample's
    segment equal the sample run alone, and check_packed on its samples (loss and every gradient,
    language model and vision tower, both boundary modes) agrees too. TOL (1e-10) is the fixed
    tolerance derived in tests/multimodal/test_exactness.py; its premises hold here: logits and
    gradients below 10 (asserted), images of at most 64 patches, segments of at most 160 tokens (90
    there: the attention sums grow by at most 70 terms, the chain n from <= 4,000 to <= 4,070, the
    bound 2 * n * u * 10 from 8.9e-12 to 9.1e-12, still 11x below TOL). Negative control: the same
    row with its images in reverse order moves some sample's logits by more than BUG."""
    _, _, samples = prepared
    _, batches, _ = runs[0]
    row = max(batches, key=lambda b: (len(b.sequence_ids), b.num_media_items))
    assert len(row.sequence_ids) >= 3 and row.num_media_items >= 4
    assert max(len(s) for s in samples.values()) <= 160
    assert max(int(s.media.grid_thw.prod(dim=1).max()) for s in samples.values()) <= 64
    rn = Renumbered(list(samples.values()))
    model = rn.model()
    fam = rn.family
    mine = [rn.sample(samples[i]) for i in row.sequence_ids]
    with torch.no_grad():
        logits = fam.packed_logits(model, _renumber(row, rn))
        shuffled = fam.packed_logits(model, _media_reversed(_renumber(row, rn)))  # negative control
        cu, cup = row.cu_seqlens.tolist(), row.cu_seqlens_padded.tolist()
        worst = 0.0
        for j, s in enumerate(mine):
            alone = fam.alone_logits(model, s)
            assert float(alone.abs().max()) < 10
            seg = slice(cup[j], cup[j] + cu[j + 1] - cu[j])
            assert float((logits[seg] - alone).abs().max()) <= TOL
            worst = max(worst, float((shuffled[seg] - alone).abs().max()))
        assert worst > BUG  # the images in the wrong order are seen: the row's media order matters
    for real in (True, False):
        r = check_packed(model, mine, pad_between_seqs=real, pad_multiple=MULT, row_width=WIDTH, pad_id=rn.pad_id)
        assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r
        assert r.within(TOL), r


@pytest.mark.parametrize("num_workers", [0, 2])
def test_save_and_restore_give_the_same_following_rows(prepared, runs, num_workers):
    path = prepared[0]
    _, batches, state = runs[num_workers]
    assert sorted(i for b in batches for i in b.sequence_ids) == sorted(prepared[2])
    again = _loader(path, num_workers)
    again.restore_state_rank(state)
    assert [sig(b) for b in again] == [sig(b) for b in batches[3:]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restore_sample_rebuilds_each_row(runs, num_workers):
    loader, batches, _ = runs[num_workers]
    assert loader.can_restore_sample()
    for b in batches:
        again = loader.restore_sample(b.__restore_key__)
        assert isinstance(again, EnergonPackedBatch)
        assert sig(again.validate()) == sig(b) and again.__key__ == b.__key__ and again.dropped == b.dropped
    assert sig(loader.restore_sample(batches[1].__restore_key__)) != sig(batches[0])


# ----------------------------------------------------------------- bad samples: counted or named
BAD = {2: b"not an image", 4: b"", 6: None}  # undecodable, zero bytes, file missing


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    convs = list(vqa_corpus(seed=2, limit=10, min_side=56, max_side=112))
    root = tmp_path_factory.mktemp("energon_media_bad") / "vqa"
    _prepare(root, convs, damage=BAD)
    return str(root), [c["id"] for c in convs]


def test_bad_images_are_counted_with_skip_and_every_sample_accounted(damaged):
    """batch_size=2: each batch carries the dropped samples of its rows; restore_sample keeps them.
    One sample (index 5, 126 tokens) is longer than a 124-token row: dropped as over-long."""
    path, ids = damaged
    loader = _loader(path, 0, batch_size=2, max_seq_len=124, on_bad_row="skip", overlong="drop")
    batches = list(loader)
    kept = [i for b in batches for i in b.sequence_ids]
    dropped = dict(d for b in batches for d in b.dropped)
    assert dropped == {
        ids[5]: "overlong",
        ids[2]: "image_undecodable",
        ids[4]: "image_zero_size",
        ids[6]: "image_missing_file",
    }
    assert sorted(kept + list(dropped)) == sorted(ids) and len(kept) == len(set(kept))
    for b in batches:
        again = loader.restore_sample(b.__restore_key__)
        assert sig(again) == sig(b) and again.dropped == b.dropped


def test_bad_images_raise_by_name_by_default(damaged):
    path, ids = damaged
    with pytest.raises(
        BadImageError,
        match=r"Energon sample '000002' of shard-0.tar \(id 'easy-vqa:train:\S+'\)"
        r"\", messages\[0\]\.content\[0\]\.path: the file 'img0.png' \(12 bytes\) cannot be decoded",
    ):
        list(_loader(path, 0))


def test_overlong_is_refused_by_name_unless_dropped(damaged):
    path, _ = damaged
    with pytest.raises(OverlongError, match=r"Energon sample '000005' .* has 126 tokens .* cannot split it"):
        list(_loader(path, 0, max_seq_len=124, on_bad_row="skip"))
    with pytest.raises(OverlongError, match=r"vision patches, more than max_patches_per_row=40"):
        list(_loader(path, 0, max_patches_per_row=40, on_bad_row="skip", overlong="error"))


def test_over_the_patch_budget_is_dropped_and_counted_as_on_every_path(damaged):
    """Issue 26 item 3: the loader and the image prepack drop and count a sample over the patch
    budget under the default overlong='split'; the Energon encoder raised instead."""
    path, _ = damaged
    batches = list(_loader(path, 0, max_seq_len=256, max_patches_per_row=40, on_bad_row="skip"))
    reasons = dict(d for b in batches for d in b.dropped)
    assert "over_patch_budget" in reasons.values()
    assert all(b.media is None or b.media.pixel_values.shape[0] <= 40 for b in batches)


def test_encoder_refuses_what_it_cannot_do(damaged):
    with pytest.raises(ValueError, match="overlong='truncate' is not offered"):
        PackingTaskEncoder(max_seq_len=64, overlong="truncate", max_patches_per_row=100)
    with pytest.raises(ValueError, match="overlong='truncate' is not offered for a conversation tokenized with"):
        list(_loader(damaged[0], 0, max_patches_per_row=None, overlong="truncate"))
    with pytest.raises(ValueError, match="on_bad_row must be 'error' or 'skip'"):
        PackingTaskEncoder(max_seq_len=64, on_bad_row="ignore")
    with pytest.raises(ValueError, match="max_seq_len=30 is not a multiple of pad_multiple=4"):
        PackingTaskEncoder(max_seq_len=30, pad_multiple=4)
    with pytest.raises(ValueError, match="PackingTaskEncoder: pad_id must be a non-negative integer"):
        PackingTaskEncoder(max_seq_len=64, pad_id=-1)


def test_a_buffer_of_only_left_out_samples_is_skipped_with_a_warning():
    """No row to carry their count: Energon skips the buffer (SkipSample) and a warning names the ids."""
    from megatron.energon import SkipSample

    empty = np.zeros(0, np.int64)
    left = [
        TokenizedSample(
            __key__=k,
            __restore_key__=(),
            input_ids=empty,
            loss_mask=empty.astype(bool),
            conversation_id=k,
            dropped="overlong",
        )
        for k in ("x", "y")
    ]
    with pytest.warns(UserWarning, match=r"no sample to pack \(left out: x \(overlong\), y \(overlong\)\)"):
        with pytest.raises(SkipSample):
            PackingTaskEncoder(max_seq_len=64).select_samples_to_pack(left)


def test_conversations_with_and_without_images_share_the_one_encoder(tmp_path):
    """Text-only conversations beside ones with images: tokenized for the same family, packed into the
    same rows (a text-only sample's media None), every sample once, each row from_samples of its samples."""
    convs = list(vqa_corpus(seed=5, limit=8, min_side=56, max_side=112))
    text = {1, 4, 6}
    for k in text:
        convs[k] = {
            "id": convs[k]["id"],
            "messages": [
                {**m, "content": [p for p in m["content"] if p["type"] != "image"]}
                if isinstance(m["content"], list)
                else m
                for m in convs[k]["messages"]
            ],
        }
    refs = _prepare(tmp_path / "mixed", convs)
    samples = {cid: tokenize_media_conversation(msgs, conversation_id=cid)[0] for cid, msgs in refs.items()}
    batches = list(_loader(str(tmp_path / "mixed"), 0))
    assert sorted(i for b in batches for i in b.sequence_ids) == sorted(samples)
    assert sum(b.num_media_items for b in batches) == sum(
        s.media.num_items for s in samples.values() if s.media is not None
    )
    assert any(samples[c].media is None or samples[c].media.num_items == 0 for b in batches for c in b.sequence_ids)
    for b in batches:
        want = PackedBatch.from_samples(
            [samples[c] for c in b.sequence_ids], max_seq_len=WIDTH, pad_multiple=MULT, pad_id=_QWEN2VL_PAD
        )
        assert b.dropped == () and sig(b) == sig(want)
