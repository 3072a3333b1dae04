"""The loader path with media: ``PackingDataset`` packs samples and conversations with images while streaming.

Rows are always ``max_seq_len`` wide, every item read is packed, split or dropped under a
counted reason, the media travel in row order, a row from the stream run through a tiny
float64 Qwen2-VL equals each of its samples run alone (both boundary modes), the patch
budget holds, resume is exact, and 2 DataLoader workers give the rows of the two shares,
interleaved round-robin (the text loader's documented order).

Tolerance of the exactness tests, fixed: 1e-10 in float64 (u = 2**-53 = 1.1e-16), derived
as in tests/multimodal/test_exactness.py. The packed row and each sample alone compute the
same function; only summation orders differ, and an n-term sum in any order is off by at
most n*u of its terms' magnitude sum (Higham, Accuracy and Stability, section 3.1). The
longest chain of roundings in one forward and backward pass is n <= 4,000 here too (the
patch embedding's 1,176-term dot products, then width 32 over 2 vision and 2 text layers,
rows of 160 slots so segments <= 160 tokens, logits over <= 130 ids, <= 64 patches per
image at 56-112 px), so each run is off by <= 4.4e-13 relative, the two by <= 8.9e-13, on
logits and gradients of magnitude <= 10 (asserted): <= 8.9e-12; 1e-10 is 11x that.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("easy_vqa")
pytest.importorskip("PIL")
pytest.importorskip("transformers")

from sftpack import PackedBatch, Sample  # noqa: E402
from sftpack.loader import LoaderStats, PackingDataset, StateError  # noqa: E402
from sftpack.loader._source import Item  # noqa: E402
from sftpack.multimodal import (  # noqa: E402
    BadImageError,
    check_packed,
    tokenize_media_conversations,
    vqa_corpus,
)
from tests.multimodal.conftest import Renumbered  # noqa: E402

TOL = 1e-10  # float64; see the module docstring
BUG = 1e-4  # what a wrong image moves something by, at least (as tests/multimodal/test_exactness.py)
WIDTH = 160  # row width: the longest sample here is 130 tokens


@pytest.fixture(scope="module")
def convs():
    """Twelve easy-vqa conversations (one or two images, 56-112 px a side)."""
    return list(vqa_corpus(seed=3, limit=12, min_side=56, max_side=112))


@pytest.fixture(scope="module")
def renumbered(convs):
    return Renumbered(list(tokenize_media_conversations(convs)))


@pytest.fixture(scope="module")
def model(renumbered):
    torch.set_num_threads(1)
    return renumbered.model()


def _kw(renumbered, **kw):
    return {"max_seq_len": WIDTH, "buffer_size": 5, "pad_multiple": 4, "pad_id": renumbered.pad_id} | kw


def sig(row) -> tuple:
    return (
        row.input_ids.numpy().tobytes(),
        row.labels.numpy().tobytes(),
        row.cu_seqlens.tolist(),
        row.cu_seqlens_padded.tolist(),
        row.sequence_ids,
        row.media.pixel_values.numpy().tobytes(),
        row.media.grid_thw.tolist(),
        row.media.positions.numpy().tobytes(),
    )


def test_rows_are_full_width_with_every_sample_once_and_media_in_row_order(renumbered):
    by_id = {s.conversation_id: s for s in renumbered.samples}
    ds = PackingDataset(renumbered.samples, **_kw(renumbered))
    rows = list(ds)
    assert len(rows) >= 4
    seen = []
    for row in rows:
        row.validate()
        assert isinstance(row, PackedBatch) and row.has_media and row.num_tokens == WIDTH
        items = [by_id[c] for c in row.sequence_ids]
        seen += row.sequence_ids
        # the row is its samples laid in order with their media: patches, grids, placeholder runs
        built = PackedBatch.from_samples(items, max_seq_len=WIDTH, pad_multiple=4, pad_id=renumbered.pad_id)
        assert sig(row) == sig(built)
        assert torch.equal(row.media.pixel_values, torch.cat([s.media.pixel_values for s in items]))
        assert row.media.grid_thw.tolist() == [g for s in items for g in s.media.grid_thw.tolist()]
        for (start, n), k in zip(row.media.slots.tolist(), row.media.sequence.tolist()):
            a = int(row.cu_seqlens_padded[k])  # sample k's segment starts here, its real tokens run L long
            assert a <= start < start + n <= a + int(row.cu_seqlens[k + 1] - row.cu_seqlens[k])
            assert bool((row.input_ids[start : start + n] == renumbered.id(151655)).all())
    assert sorted(seen) == sorted(by_id)  # every sample exactly once
    st = ds.stats
    assert st.samples_in == len(by_id) == st.samples_packed + st.dropped_total and st.dropped_total == 0
    assert st.rows_out == len(rows) and st.slots == WIDTH * len(rows)
    assert st.images_out == sum(s.media.num_items for s in renumbered.samples) == sum(r.num_media_items for r in rows)
    assert st.real_tokens == sum(len(s) for s in renumbered.samples)


def _stream_check(model, renumbered, rows, by_id, *, pad_between_seqs, tamper=None):
    """check_packed with the stream's rows (laid end to end) in place of a row it builds itself."""
    items = [by_id[c] for r in rows for c in r.sequence_ids]
    run = PackedBatch.concat(rows).validate()

    def use_stream(_built):
        return run if tamper is None else tamper(run)

    return check_packed(
        model, items, pad_between_seqs=pad_between_seqs, pad_multiple=4, pad_id=renumbered.pad_id, tamper=use_stream
    )


@pytest.mark.parametrize("pad_between_seqs", [True, False], ids=["real", "padded"])
def test_stream_rows_equal_each_sample_alone(renumbered, model, pad_between_seqs):
    """Two rows from the stream as one micro-batch (concat), through the tiny float64 Qwen2-VL:
    logits, loss, language and vision gradients equal each sample run alone."""
    by_id = {s.conversation_id: s for s in renumbered.samples}
    rows = list(PackingDataset(renumbered.samples, **_kw(renumbered)))[:2]
    assert sum(len(r.sequence_ids) for r in rows) >= 4
    r = _stream_check(model, renumbered, rows, by_id, pad_between_seqs=pad_between_seqs)
    assert r.max_abs_logit < 10 and r.max_abs_grad < 10, r  # the premise of TOL
    assert r.within(TOL), r


def test_negative_control_images_of_a_stream_row_swapped_fail(renumbered, model):
    """The same check fails when the row's images are laid in the wrong order."""
    by_id = {s.conversation_id: s for s in renumbered.samples}
    rows = list(PackingDataset(renumbered.samples, **_kw(renumbered)))
    row = next(r for r in rows if len({tuple(g) for g in r.media.grid_thw.tolist()}) > 1)

    def reversed_media(b):
        m = b.media
        grid = m.grid_thw
        per = (grid[:, 0] * grid[:, 1] * grid[:, 2]).tolist()
        blocks = list(torch.split(m.pixel_values, per))
        # the tower's per-image boundaries (media.vision_cu_seqlens) follow the reversed grids
        return dataclasses.replace(
            b, media=dataclasses.replace(m, pixel_values=torch.cat(blocks[::-1]), grid_thw=grid.flip(0))
        )

    r = _stream_check(model, renumbered, [row], by_id, pad_between_seqs=False, tamper=reversed_media)
    assert max(r.logits, r.loss, r.grads["language"], r.grads["vision"]) > BUG, r


def test_the_patch_budget_holds_and_bites(renumbered):
    patches = [s.num_patches for s in renumbered.samples]
    budget = 100
    assert max(patches) <= budget
    free = list(PackingDataset(renumbered.samples, **_kw(renumbered)))
    assert max(r.media.num_patches for r in free) > budget  # without it, some row holds more
    capped = PackingDataset(renumbered.samples, **_kw(renumbered, max_patches_per_row=budget))
    rows = list(capped)
    assert all(r.media.num_patches <= budget and r.num_tokens == WIDTH for r in rows)
    assert sorted(c for r in rows for c in r.sequence_ids) == sorted(s.conversation_id for s in renumbered.samples)
    assert capped.stats.patches_out == sum(patches)
    # a sample over the budget fits no row: counted, or an error under overlong="error"
    small = PackingDataset(renumbered.samples, **_kw(renumbered, max_patches_per_row=60))
    kept = list(small)
    over = sum(p > 60 for p in patches)
    assert over >= 1 and small.stats.dropped_by == {"over_patch_budget": over} and small.stats.dropped == over
    assert small.stats.samples_in == small.stats.samples_packed + over
    assert sum(len(r.sequence_ids) for r in kept) == len(patches) - over
    with pytest.raises(
        ValueError, match=r"vision patches, more than max_patches_per_row=60.*raise max_patches_per_row"
    ):
        list(PackingDataset(renumbered.samples, **_kw(renumbered, max_patches_per_row=60, overlong="error")))


def test_overlong_samples_split_at_text_boundaries_and_counted(renumbered):
    width = 64
    long = [s for s in renumbered.samples if len(s) > width]
    assert long
    ds = PackingDataset(renumbered.samples, **_kw(renumbered, max_seq_len=width))
    rows = list(ds)
    img = renumbered.id(151655)
    for r in rows:
        r.validate()
        assert r.num_tokens == width
        for (start, n), k in zip(r.media.slots.tolist(), r.media.sequence.tolist()):
            # the whole placeholder run, with <|vision_start|> before it, inside one segment
            assert int(r.cu_seqlens_padded[k]) < start and bool((r.input_ids[start : start + n] == img).all())
    st = ds.stats
    assert st.split == len(long) and st.extra_pieces >= len(long)
    assert st.samples_in == st.samples_packed + st.dropped_total == len(renumbered.samples)
    assert st.images_out == sum(s.media.num_items for s in renumbered.samples)  # every image once
    assert st.real_tokens == sum(len(s) for s in renumbered.samples)  # no token lost
    dropped = PackingDataset(renumbered.samples, **_kw(renumbered, max_seq_len=width, overlong="drop"))
    list(dropped)
    assert dropped.stats.dropped_by == {"overlong": len(long)} and dropped.stats.dropped == len(long)
    with pytest.raises(ValueError, match="truncate"):
        list(PackingDataset(renumbered.samples, **_kw(renumbered, overlong="truncate")))
    with pytest.raises(ValueError, match="truncate"):  # a patch budget means samples with media
        PackingDataset(renumbered.samples, **_kw(renumbered, overlong="truncate", max_patches_per_row=100))


def test_bad_images_are_counted_or_named(convs, tmp_path):
    """Conversations tokenized in the stream: a missing and an undecodable image are counted under
    their reasons (on_bad_row="skip") or raise naming the record and field."""
    bad = copy.deepcopy(convs[:2])
    bad[0]["id"], bad[1]["id"] = "gone", "garbled"
    bad[0]["messages"][0]["content"][0] = {"type": "image", "path": str(tmp_path / "gone.png")}
    bad[1]["messages"][0]["content"][0] = {"type": "image", "bytes": b"\x89PNG not really"}
    items = convs[2:6] + bad
    ds = PackingDataset(lambda: iter(items), max_seq_len=256, buffer_size=8, on_bad_row="skip")
    rows = list(ds)
    st = ds.stats
    assert st.dropped_by == {"image_missing_file": 1, "image_undecodable": 1} == st.reasons and st.dropped == 2
    assert st.samples_in == 6 == st.samples_packed + st.dropped_total
    assert sorted(c for r in rows for c in r.sequence_ids) == sorted(c["id"] for c in convs[2:6])
    assert all(r.num_tokens == 256 for r in rows)
    with pytest.raises(BadImageError, match=r"gone.*messages\[0\]\.content\[0\]"):
        list(PackingDataset(lambda: iter(items), max_seq_len=256, buffer_size=8))


RESUME = {"buffer_size": 4, "shuffle": True, "seed": 7, "num_epochs": 2, "max_patches_per_row": 120}


def test_resume_at_any_row_is_exact_and_seeded(renumbered):
    kw = _kw(renumbered, **RESUME)
    full = [sig(r) for r in PackingDataset(renumbered.samples, **kw)]
    assert [sig(r) for r in PackingDataset(renumbered.samples, **kw)] == full  # same seed, same rows
    other = [sig(r) for r in PackingDataset(renumbered.samples, **(kw | {"seed": 8}))]
    assert other != full
    ref = PackingDataset(renumbered.samples, **kw)
    it = iter(ref)
    kinds = set()
    for k in range(len(full) + 1):
        st = json.loads(json.dumps(ref.state_dict()))  # plain data
        kinds |= {"pending"} if st["pending"] else set()
        kinds |= {"buffer"} if st["buffer"] else set()
        fresh = PackingDataset(renumbered.samples, **kw)
        fresh.load_state_dict(st)
        assert [sig(r) for r in fresh] == full[k:], f"resume after row {k}"
        if k < len(full):
            assert sig(next(it)) == full[k]
    assert kinds == {"pending", "buffer"}
    assert LoaderStats.from_state(ref.state_dict()).epochs == 2
    with pytest.raises(StateError, match=r"other arguments \(max_patches_per_row: saved 120, here 100\)"):
        PackingDataset(renumbered.samples, **(kw | {"max_patches_per_row": 100})).load_state_dict(st)
    # a state saved over other items is refused before it emits a row
    st = PackingDataset(renumbered.samples, **kw)
    it = iter(st)
    next(it)
    saved = st.state_dict()
    assert saved["buffer"] or saved["pending"]
    other_data = PackingDataset(renumbered.samples[::-1], **kw)
    other_data.load_state_dict(saved)
    with pytest.raises(StateError, match="saved over other data"):
        next(iter(other_data))


def test_resume_from_conversations_re_tokenizes_only_what_it_needs(convs):
    """A callable source of conversations: the restored rows are the same bytes."""
    kw = {"max_seq_len": 256, "buffer_size": 3, "max_wait": 1}
    full = [sig(r) for r in PackingDataset(lambda: iter(convs[:8]), **kw)]
    ref = PackingDataset(lambda: iter(convs[:8]), **kw)
    it = iter(ref)
    next(it)
    st = ref.state_dict()
    assert st["buffer"] or st["pending"]
    fresh = PackingDataset(lambda: iter(convs[:8]), **kw)
    fresh.load_state_dict(st)
    assert [sig(r) for r in fresh] == full[1:]


def _interleave(*shares):
    out, rows = [], [list(s) for s in shares]
    while any(rows):
        for r in rows:
            if r:
                out.append(r.pop(0))
    return out


def test_two_workers_give_the_two_shares_rows_interleaved(renumbered):
    kw = _kw(renumbered, max_patches_per_row=120)
    one = [sig(r) for r in DataLoader(PackingDataset(renumbered.samples, **kw), batch_size=None)]
    shares = [[sig(r) for r in PackingDataset(renumbered.samples, rank=w, world_size=2, **kw)] for w in (0, 1)]
    two = [sig(r) for r in DataLoader(PackingDataset(renumbered.samples, **kw), batch_size=None, num_workers=2)]
    assert two == _interleave(*shares)
    ids = sorted(s.conversation_id for s in renumbered.samples)
    assert sorted(c for s in one for c in s[4]) == ids == sorted(c for s in two for c in s[4])
    # micro-batches of two rows laid end to end by the collate
    rows = list(PackingDataset(renumbered.samples, **kw))
    pairs = DataLoader(PackingDataset(renumbered.samples, **kw), batch_size=2, collate_fn=PackedBatch.concat)
    got = [sig(b.validate()) for b in pairs]
    assert got == [sig(PackedBatch.concat(rows[i : i + 2])) for i in range(0, len(rows), 2)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_through_the_stateful_loader(renumbered, num_workers):
    from sftpack.loader import StatefulLoader

    kw = _kw(renumbered, **RESUME)

    def loader():
        return StatefulLoader(PackingDataset(renumbered.samples, **kw), num_workers=num_workers)

    full = [sig(r) for r in loader()]
    ref = loader()
    it = iter(ref)
    k = len(full) // 2 + 1
    for _ in range(k):
        next(it)
    st = ref.state_dict()
    again = loader()
    again.load_state_dict(st)
    assert [sig(r) for r in again] == full[k:]
    assert LoaderStats.from_state(st).rows_out == k


# ------------------------------------------------------------------ text and media in one dataset
def same_fields(got, want, where="row"):
    """Every field of two batches (or two media payloads) equal: tensors in dtype, shape and value."""
    assert type(got) is type(want), where
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "media":
            assert (a is None) == (b is None), where
            if b is not None:
                same_fields(a, b, f"{where}.media")
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}.{f.name}"
        else:
            assert a == b, f"{where}.{f.name}"


def _mixed(renumbered, n_text=10, seed=4):
    """The samples with images and text-only samples (``media`` None) over the same vocabulary, interleaved."""
    rng = np.random.default_rng(seed)
    text = [
        Sample(rng.integers(0, renumbered.id(151643), int(n)), rng.random(int(n)) < 0.7, f"t{i}")
        for i, n in enumerate(rng.integers(5, WIDTH, n_text))
    ]
    out = list(renumbered.samples)
    for i, t in enumerate(text):
        out.insert(2 * i + 1, t)
    return out


def msig(row) -> tuple:
    media = () if row.media is None else (row.media.pixel_values.numpy().tobytes(), row.media.grid_thw.tolist())
    return (row.input_ids.numpy().tobytes(), row.cu_seqlens_padded.tolist(), row.sequence_ids, media)


def test_text_and_media_samples_share_rows_each_equal_to_from_samples(renumbered):
    items = _mixed(renumbered)
    by_id = {s.conversation_id: s for s in items}
    ds = PackingDataset(items, **_kw(renumbered, max_patches_per_row=120))
    rows = list(ds)
    kinds = set()
    for row in rows:
        row.validate()
        assert row.num_tokens == WIDTH and (row.media is None or row.media.num_patches <= 120)
        samples = [by_id[c] for c in row.sequence_ids]
        has = [s.media is not None for s in samples]
        kinds.add("mixed" if any(has) and not all(has) else "media" if all(has) else "text")
        # a row holding media (or text only) is PackedBatch.from_samples of its samples, field for field
        same_fields(row, PackedBatch.from_samples(samples, max_seq_len=WIDTH, pad_multiple=4, pad_id=renumbered.pad_id))
    assert "mixed" in kinds
    assert sorted(c for r in rows for c in r.sequence_ids) == sorted(by_id)
    st = ds.stats
    assert st.samples_in == len(items) == st.samples_packed and st.dropped == 0
    assert st.images_out == sum(s.media.num_items for s in renumbered.samples)
    assert st.patches_out == sum(s.num_patches for s in renumbered.samples)
    assert st.real_tokens == sum(len(s) for s in items)


def test_text_samples_in_a_media_dataset_keep_the_text_rules(renumbered):
    """A long text-only sample splits as text would (into full pieces), beside samples with media."""
    rng = np.random.default_rng(9)
    long = Sample(rng.integers(0, renumbered.id(151643), 2 * WIDTH + 7), np.ones(2 * WIDTH + 7, bool), "long")
    ds = PackingDataset([long, *renumbered.samples], **_kw(renumbered, max_patches_per_row=120))
    rows = list(ds)
    assert ds.stats.split == 1 and ds.stats.extra_pieces == 2
    pieces = [r for r in rows if "long" in r.sequence_ids]
    assert sum(
        int(r.cu_seqlens[i + 1] - r.cu_seqlens[i]) for r in pieces for i, c in enumerate(r.sequence_ids) if c == "long"
    ) == len(long)
    text_only = PackingDataset([long], max_seq_len=WIDTH, buffer_size=5, pad_multiple=4, overlong="truncate")
    assert [r.cu_seqlens.tolist() for r in text_only] == [[0, WIDTH]] and text_only.stats.truncated == 1


def test_a_mixed_stream_resumes_exactly_at_any_row(renumbered):
    items = _mixed(renumbered)
    kw = _kw(renumbered, **RESUME)
    full = [msig(r) for r in PackingDataset(items, **kw)]
    ref = PackingDataset(items, **kw)
    it = iter(ref)
    for k in range(len(full) + 1):
        st = json.loads(json.dumps(ref.state_dict()))
        fresh = PackingDataset(items, **kw)
        fresh.load_state_dict(st)
        assert [msig(r) for r in fresh] == full[k:], f"resume after row {k}"
        if k < len(full):
            assert msig(next(it)) == full[k]
    assert LoaderStats.from_state(ref.state_dict()).images_out == 2 * sum(s.media.num_items for s in renumbered.samples)


def test_a_fingerprint_covers_the_media(renumbered):
    """The same tokens with another image grid (or none) are other data to a state."""
    s = renumbered.samples[0]
    grid = s.media.grid_thw.clone()
    grid[0, [1, 2]] = grid[0, [2, 1]]
    assert not torch.equal(grid, s.media.grid_thw)
    other = dataclasses.replace(s.media, grid_thw=grid)
    items = [Item((0, 0), s.input_ids, s.loss_mask, s.conversation_id, len(s), 0, m) for m in (s.media, other)]
    text = Item((0, 0), s.input_ids, s.loss_mask, s.conversation_id, len(s))
    assert len({items[0].digest(), items[1].digest(), text.digest()}) == 3
