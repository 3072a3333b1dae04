"""A loader state is refused over other data of the same length, and with counts that do not add up
(issue 26, item 8).

Before: a ``PackingDataset`` state (of text samples, or of samples with media) loaded over the same number of
samples in another order (or with samples replaced) resumed silently whenever the re-read samples
had the lengths the state recorded, edited ``stats`` were taken as they were, an Energon
``restore_state_rank`` over reversed data or a changed shard resumed silently, and invalid JSON in
an Energon sample raised a bare ``JSONDecodeError`` even with ``on_bad_row="skip"``. Now each is a
:class:`StateError` (or a named error) that names the field, or a counted ``bad_record``.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from sftpack.handoff.payload import PatchMedia
from sftpack.loader import LoaderStats, PackingDataset, StateError
from sftpack.sample import Sample

# ------------------------------------------------------------------ text: equal lengths, other data
N, L = 60, 50
KW = {"max_seq_len": 256, "buffer_size": 12, "pad_multiple": 4, "num_epochs": 1}


def text_samples(order=None) -> list[Sample]:
    """N samples of L tokens each (equal lengths: only their content and ids tell them apart)."""
    out = [Sample(1000 * (i + 1) + np.arange(L, dtype=np.int64), np.ones(L, bool), i) for i in range(N)]
    return [out[i] for i in order] if order is not None else out


def sig(row) -> tuple:
    return (row.input_ids.numpy().tobytes(), row.cu_seqlens_padded.tolist(), tuple(row.sequence_ids))


def state_after(ds, k: int) -> dict:
    it = iter(ds)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(ds.state_dict()))


def swapped(st: dict, n: int) -> list[int]:
    """An order of n samples where the first one the state holds is replaced by the last sample."""
    held = st["buffer"][0][0] if st["buffer"] else st["pending"][0][0][0]
    order = list(range(n))
    order[held], order[-1] = order[-1], order[held]
    return order


def test_a_text_state_over_reversed_or_replaced_data_of_equal_lengths_is_refused():
    full = [sig(r) for r in PackingDataset(text_samples(), **KW)]
    st = state_after(PackingDataset(text_samples(), **KW), 2)
    assert st["buffer"] or st["pending"]
    again = PackingDataset(text_samples(), **KW)  # the same data: still exact
    again.load_state_dict(st)
    assert [sig(r) for r in again] == full[2:]
    for other in (text_samples(range(N - 1, -1, -1)), text_samples(swapped(st, N))):
        ds = PackingDataset(other, **KW)
        ds.load_state_dict(st)
        with pytest.raises(
            StateError,
            match=r"state\['(digests'\]\[\d+\]|last'\]) .*sample \d+ .*other tokens or another id here than when "
            r"the state was saved: the state was saved over other data",
        ):
            next(iter(ds))


def test_a_text_state_with_an_empty_buffer_still_checks_the_last_sample_read():
    """max_wait=0 after a buffer's last row: nothing buffered or pending, only the cursor; the last
    sample read is re-read and compared."""
    kw = KW | {"max_wait": 0}
    rows = 0
    ds = PackingDataset(text_samples(), **kw)
    it = iter(ds)
    while True:
        next(it)
        rows += 1
        st = json.loads(json.dumps(ds.state_dict()))
        if not st["buffer"] and not st["pending"] and st["cursor"]:
            break
    full = [sig(r) for r in PackingDataset(text_samples(), **kw)]
    again = PackingDataset(text_samples(), **kw)
    again.load_state_dict(st)
    assert [sig(r) for r in again] == full[rows:]
    rev = PackingDataset(text_samples(range(N - 1, -1, -1)), **kw)
    rev.load_state_dict(st)
    with pytest.raises(StateError, match=r"state\['last'\] = \[\d+, .*the last sample read before the save"):
        next(iter(rev))


# ------------------------------------------------------------------ stats that do not add up
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.update(rows_out=s["rows_out"] + 1),
            r"state\['stats'\]\['slots'\] = \d+ but rows_out x max_seq_len = \d+ x 256 = \d+",
        ),
        (
            lambda s: s.update(samples_in=s["samples_in"] + 3),
            r"state\['stats'\]: samples_in - dropped \+ extra_pieces = \d+ - 0 \+ 0 = \d+ sequences read, but "
            r"sequences_out \+ buffered \+ pending \+ abandoned = \d+ \+ \d+ \+ \d+ \+ 0 = \d+",
        ),
        (lambda s: s.update(fill=0.99), r"state\['stats'\]\['fill'\] = 0.99 but real_tokens / slots"),
        (lambda s: s.update(bogus=1), r"state\['stats'\] holds 'bogus', which a PackingDataset state has not"),
        (lambda s: s.pop("split"), r"state\['stats'\] lacks 'split'"),
        (lambda s: s.update(max_waited=7), r"state\['stats'\]\['max_waited'\] = 7, more than max_wait=2"),
        (
            lambda s: s.update(real_tokens=s["slots"] + 1),
            r"state\['stats'\]\['real_tokens'\] = \d+, more than its slots",
        ),
    ],
)
def test_edited_stats_are_refused_naming_the_field(edit, message):
    st = state_after(PackingDataset(text_samples(), **KW), 2)
    bad = copy.deepcopy(st)
    edit(bad["stats"])
    with pytest.raises(StateError, match=message):
        PackingDataset(text_samples(), **KW).load_state_dict(bad)


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_state_version_is_refused_with_what_to_do(version):
    st = state_after(PackingDataset(text_samples(), **KW), 2)
    assert st["version"] == 3
    st["version"] = version
    with pytest.raises(
        StateError,
        match=rf"state version {version}, saved by an older sftpack.*this sftpack reads version 3.*start the epoch over",
    ):
        PackingDataset(text_samples(), **KW).load_state_dict(st)


# ------------------------------------------------------------------ multimodal: the same checks
def mm_samples(order=None) -> list[Sample]:
    """24 samples with one 4x4-patch image each and equal lengths (26 tokens); text tokens tell them apart."""
    out = []
    for i in range(24):
        ids = np.array([10 + i] * 5 + [151652] + [151655] * 4 + [151653] + [10 + i] * 15)
        out.append(
            Sample(
                ids,
                ids == 10 + i,
                f"c{i}",
                media=PatchMedia(
                    np.full((16, 1176), i, np.float32),
                    slots=[(6, 4)],
                    sequence=[0],
                    token_id=151655,
                    grid_thw=[(1, 4, 4)],
                    merge_size=2,
                ),
            )
        )
    return [out[i] for i in order] if order is not None else out


MM = {"max_seq_len": 64, "buffer_size": 6, "max_patches_per_row": 48, "pad_multiple": 4}


def mm_sig(row) -> tuple:
    return (row.input_ids.numpy().tobytes(), row.media.pixel_values.numpy().tobytes(), tuple(row.sequence_ids))


def test_a_multimodal_state_over_reversed_or_replaced_items_is_refused():
    full = [mm_sig(r) for r in PackingDataset(mm_samples(), **MM)]
    st = state_after(PackingDataset(mm_samples(), **MM), 3)
    assert st["buffer"] or st["pending"]
    again = PackingDataset(mm_samples(), **MM)
    again.load_state_dict(st)
    assert [mm_sig(r) for r in again] == full[3:]
    for other in (mm_samples(range(23, -1, -1)), mm_samples(swapped(st, 24))):
        ds = PackingDataset(other, **MM)
        ds.load_state_dict(st)
        with pytest.raises(StateError, match=r"state\['(digests|last)'\].*other tokens or another id here"):
            next(iter(ds))


def test_multimodal_stats_that_do_not_add_up_are_refused():
    st = state_after(PackingDataset(mm_samples(), **MM), 3)
    assert LoaderStats.from_state(st).rows_out == 3
    bad = copy.deepcopy(st)
    bad["stats"]["dropped:bad_record"] = 2
    bad["stats"]["dropped"] = 2
    with pytest.raises(StateError, match=r"samples_in - dropped \+ extra_pieces = \d+ - 2 \+ 0"):
        PackingDataset(mm_samples(), **MM).load_state_dict(bad)
    bad = copy.deepcopy(st)
    bad["stats"]["dropped:bad_record"] = 2  # a reason without the drop it counts
    with pytest.raises(StateError, match=r"dropped:bad_record: 2\) are more than dropped = 0"):
        PackingDataset(mm_samples(), **MM).load_state_dict(bad)
    bad = copy.deepcopy(st)
    bad["stats"]["patches_out"] = 1000
    with pytest.raises(
        StateError, match=r"state\['stats'\]\['patches_out'\] = 1000, more than rows_out x max_patches_per_row"
    ):
        PackingDataset(mm_samples(), **MM).load_state_dict(bad)
    assert LoaderStats.from_state(state_after(PackingDataset(text_samples(), **KW), 1)).rows_out == 1


def test_a_state_of_the_old_multimodal_loader_is_refused_with_what_to_do():
    """What ``MultimodalPackingDataset`` (merged into ``PackingDataset``) saved: version 2, its own config."""
    st = state_after(PackingDataset(mm_samples(), **MM), 3)
    st["version"] = 2
    st["config"] = {"kind": "multimodal", **{k: v for k, v in st["config"].items() if k != "max_patches_per_row"}}
    st["config"]["max_patches"] = 48
    with pytest.raises(StateError, match=r"state version 2, saved by an older sftpack.*start the epoch over"):
        PackingDataset(mm_samples(), **MM).load_state_dict(st)


def test_a_media_argument_is_compared_when_only_one_side_sets_it():
    """The media arguments join a state's config only when set: a state saved without a patch budget
    is refused by a dataset with one, and the other way round."""
    st = state_after(PackingDataset(mm_samples(), **MM), 1)
    with pytest.raises(StateError, match=r"max_patches_per_row: saved 48, here None"):
        PackingDataset(mm_samples(), **(MM | {"max_patches_per_row": None})).load_state_dict(st)
    free = {k: v for k, v in MM.items() if k != "max_patches_per_row"}
    st = state_after(PackingDataset(mm_samples(), **free), 1)
    assert "max_patches_per_row" not in st["config"]
    with pytest.raises(StateError, match=r"max_patches_per_row: saved None, here 48"):
        PackingDataset(mm_samples(), **MM).load_state_dict(st)


# ------------------------------------------------------------------ Energon: bad JSON, and states over other data
def _energon_shard(root, convs, bad_json=None):
    """The easy-vqa WebDataset shard of tests/loader/test_energon_media.py, prepared with Energon;
    ``bad_json``: {sample index: bytes stored as its KEY.json instead}."""
    import tarfile

    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors import BaseWebdatasetFactory

    from tests.loader.test_energon_media import _add, _write_shard

    root.mkdir()
    _write_shard(root / "plain.tar", convs)
    with tarfile.open(root / "plain.tar") as src, tarfile.open(root / "shard-0.tar", "w") as out:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            k = int(m.name.split(".")[0])
            _add(out, m.name, bad_json[k] if m.name.endswith(".json") and k in (bad_json or {}) else data)
    (root / "plain.tar").unlink()
    BaseWebdatasetFactory.prepare_dataset(
        EPath(str(root)), ["shard-0.tar"], split_parts_ratio=[("train", 1.0)], workers=1, shuffle_seed=None
    )
    (root / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    return str(root)


@pytest.fixture(scope="module")
def vqa10():
    pytest.importorskip("megatron.energon")
    pytest.importorskip("easy_vqa")
    from sftpack.multimodal import vqa_corpus

    return list(vqa_corpus(seed=2, limit=10, min_side=56, max_side=112))


def _mm_loader(path, **kw):
    from tests.loader.test_energon_media import _loader

    return _loader(path, 0, **kw)


def test_invalid_json_in_an_energon_sample_is_counted_or_named(vqa10, tmp_path):
    path = _energon_shard(tmp_path / "vqa", vqa10, bad_json={3: b'{"id": "x", "messages": [oops'})
    ids = [c["id"] for c in vqa10]
    batches = list(_mm_loader(path, on_bad_row="skip"))
    kept = [i for b in batches for i in b.sequence_ids]
    dropped = [d for b in batches for d in b.dropped]
    assert dropped == [("000003", "bad_record")]  # read == kept + dropped: nothing silently lost
    assert sorted(kept) == sorted(ids[:3] + ids[4:]) and len(kept) + len(dropped) == len(ids)
    with pytest.raises(
        ValueError,
        match=r"Energon sample '000003' of shard-0.tar \(id '000003'\): its .json is not valid JSON \(Expecting "
        r"value: line 1 column 26 .*it starts '\{\"id\": \"x\", \"messages\": \[oops'\): fix or remove the sample "
        r"and prepare the dataset again, or pass on_bad_row='skip'",
    ):
        list(_mm_loader(path))


def _run_save(loader, k):
    batches, state = [], None
    for i, b in enumerate(loader):
        batches.append(b)
        if i + 1 == k:
            state = loader.save_state_rank()
    return batches, state


def test_an_energon_state_over_a_changed_shard_is_refused(vqa10, tmp_path):
    from tests.loader.test_energon_media import sig as media_sig

    path = _energon_shard(tmp_path / "a", vqa10)
    batches, state = _run_save(_mm_loader(path, max_seq_len=384), 1)
    again = _mm_loader(path, max_seq_len=384)
    again.restore_state_rank(state)
    assert [media_sig(b) for b in again] == [media_sig(b) for b in batches[1:]]  # the same data: exact
    for name, convs in (("reversed", vqa10[::-1]), ("replaced", [vqa10[-1], *vqa10[1:-1], vqa10[0]])):
        other = _mm_loader(_energon_shard(tmp_path / name, convs), max_seq_len=384)
        other.restore_state_rank(state)
        with pytest.raises(
            StateError,
            match=r"the Energon state does not match this data: its sftpack StateCheck field '_last_mark'.*batch 1 "
            r"\(the last one before the save\).*: the state was saved over other data",
        ):
            next(iter(other))


def test_an_energon_state_without_the_check_is_refused(vqa10, tmp_path):
    path = _energon_shard(tmp_path / "a", vqa10)
    _, state = _run_save(_mm_loader(path, max_seq_len=384), 1)

    def strip(s):  # the state an sftpack without StateCheck saved: its inner level in its place
        if isinstance(s, dict):
            if s.get("__class__") == "StateCheck":
                return s["datasets"][0]
            return type(s)({k: strip(v) for k, v in s.items()})
        if isinstance(s, list):
            return [strip(v) for v in s]
        return s

    state.worker_states = strip(state.worker_states)
    with pytest.raises(
        StateError, match=r"this Energon state has no sftpack StateCheck level where this loader has one \(found 'Batch"
    ):
        _mm_loader(path, max_seq_len=384).restore_state_rank(state)
