"""The Ray engine's driver-side pieces, without starting Ray: units and their merge
give exactly the local engine's staging (text, and conversations with images with their
media columns), the multi-unit token source gathers exactly what one staging folder does
(tokens and pixels), the write ranges cover every row, and importing the engine loads no Ray."""

from __future__ import annotations

import pickle
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest

from sftpack.chat import BadRowError, tokenize_conversations
from sftpack.data import default_corpus
from sftpack.offline._encode import ImageCounts, encoded, image_settings
from sftpack.offline._inputs import open_image_inputs, open_inputs
from sftpack.offline._ray_units import TokenizeActor, UnitsSource, make_units, merge, split_rows
from sftpack.offline.engine import plan_rows, stage_samples
from sftpack.testing import samples_from_lengths, tiny_chat_tokenizer

OPTIONS = {"max_seq_len": 256, "overlong": "split", "train_on": "all_assistant"}


def _run_units(units, tok, images=None):
    """The actor's work, in this process, one unit per call as Ray Data hands them over."""
    actor = TokenizeActor(tok, OPTIONS, images=images)
    out = []
    for u in units:
        batch = actor({"key": np.array([u.key]), "unit": np.array([pickle.dumps(u)], dtype=object)})
        out.append(pickle.loads(batch["result"][0]))
    return out


def _iterable():
    """Conversations in three shapes: Conversation objects (ids), bare message lists
    (ids = global positions) and a dict without an id."""
    convs = list(default_corpus(limit=20))
    items: list = []
    for i, c in enumerate(convs):
        items.append(c if i % 3 == 0 else c.messages if i % 3 == 1 else {"messages": c.messages})
    return items


def test_units_of_an_iterable_merge_into_the_local_staging(tmp_path):
    tok = tiny_chat_tokenizer("chatml")
    items = _iterable()
    inputs = open_inputs(items, on_bad_row="skip", limit=17)
    units, workers_read = make_units(inputs, tmp_path / "ray", unit_size=5)
    assert inputs.reader is None and not workers_read
    assert [len(u.conversations) for u in units] == [5, 5, 5, 2] and inputs.hashing.count == 17
    results = _run_units(units, tok)
    assert all(r["ok"] for r in results)
    staged, unit_samples = merge(results, tmp_path / "ray")

    local_tok = tokenize_conversations(items[:17], tok, **OPTIONS)
    local = stage_samples(local_tok, tmp_path / "local")
    for name in ("lengths", "conversation", "piece", "conversation_offsets"):
        np.testing.assert_array_equal(getattr(staged, name), getattr(local, name), err_msg=name)
    for name in ("max_id", "tokens", "trainable", "labels", "first_trainable"):
        assert getattr(staged, name) == getattr(local, name), name
    ids = b"".join((tmp_path / "ray" / f"u{k:06d}" / "ids.json8").read_bytes() for k in range(len(units)))
    assert ids == (tmp_path / "local" / "ids.json8").read_bytes()
    assert b'"chitchat:' in ids and b",1" not in ids[:0]  # Conversation ids kept
    # a bare list at global position 16 got id 16, not its position in its unit (1)
    assert staged.conversation_offsets.shape[0] == 18
    off = staged.conversation_offsets
    assert ids[off[16] : off[17]] == b"16"
    assert unit_samples[-1] == staged.num_samples
    assert sum(r["tokenize"]["split"] for r in results) == local_tok.stats.split > 0


def test_a_bad_row_in_error_mode_comes_back_as_the_local_error(tmp_path):
    tok = tiny_chat_tokenizer("chatml")
    path = tmp_path / "chat.jsonl"
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    path.write_text(f'{good}\n{good}\n{{"messages": []}}\n{good}\n')
    inputs = open_inputs([path], on_bad_row="error", limit=None)
    units, workers_read = make_units(inputs, tmp_path / "ray", unit_size=5)
    assert workers_read and len(units) == 1 and units[0].source is not None
    assert inputs.fingerprint()[0]["size"] == path.stat().st_size
    reader = inputs.reader
    (result,) = _run_units(units, tok)
    assert not result["ok"] and isinstance(result["error"], BadRowError)
    with pytest.raises(BadRowError) as local:
        list(tokenize_conversations(reader, tok, **OPTIONS))
    assert (
        str(result["error"]) == str(local.value) and "chat.jsonl" in str(local.value) and "line 3" in str(local.value)
    )


def test_the_multi_unit_source_gathers_what_one_staging_folder_does(tmp_path):
    lengths = [5, 10, 3, 8, 6, 9, 16, 2, 1, 7, 12, 4]
    samples = samples_from_lengths(lengths)
    whole = stage_samples(samples, tmp_path / "whole")
    cuts = [0, 3, 4, 9, 12]  # four units, one of a single sample
    for k, (a, b) in enumerate(pairwise(cuts)):
        stage_samples(samples[a:b], tmp_path / f"u{k}")
    multi = UnitsSource([str(tmp_path / f"u{k}") for k in range(4)], whole.lengths, np.array(cuts))
    rng = np.random.default_rng(0)
    for request in (np.arange(12), rng.permutation(12), np.array([11, 0, 3, 3, 8]), np.array([6])):
        got, want = multi.gather(request), whole.source().gather(request)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_units_of_conversations_with_images_merge_into_the_local_staging(tmp_path):
    pytest.importorskip("easy_vqa")
    pytest.importorskip("PIL")
    from sftpack.multimodal import vqa_corpus

    convs = list(vqa_corpus(seed=1, limit=7, min_side=56, max_side=112))
    for c in convs[::3]:
        del c["id"]  # numbered by their place in the input, whatever unit they land in
    settings = image_settings(
        "qwen2_vl", None, None, max_seq_len=128, overlong="split", on_bad_row="skip", max_patches_per_row=None
    )
    counts = ImageCounts()
    local = stage_samples(counts.pairs(encoded(convs, settings)), tmp_path / "local", media=True)
    units, workers_read = make_units(open_image_inputs(convs, limit=None), tmp_path / "ray", unit_size=3, raw=True)
    assert not workers_read and [u.start for u in units] == [0, 3, 6]
    results = _run_units(units, None, images=settings)
    assert all(r["ok"] for r in results), [r.get("message") for r in results]
    staged, unit_samples = merge(results, tmp_path / "ray")
    for name in ("lengths", "conversation", "piece", "conversation_offsets"):
        np.testing.assert_array_equal(getattr(staged, name), getattr(local, name), err_msg=name)
    a, b = staged.media, local.media
    assert a.num_images == b.num_images > 7 and (a.token_id, a.merge_size) == (b.token_id, b.merge_size)
    for name in ("first_image", "patches", "pixel_offsets"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for field in ("height", "width", "grid_t", "grid_h", "grid_w", "sequence", "start"):
        np.testing.assert_array_equal(a.records[field], b.records[field], err_msg=field)
    merged = ImageCounts()
    for r in results:
        merged.merge(r["images"])
    assert merged.manifest() == counts.manifest() and merged.read == 7
    ids = b"".join((tmp_path / "ray" / f"u{k:06d}" / "ids.json8").read_bytes() for k in range(len(units)))
    assert ids == (tmp_path / "local" / "ids.json8").read_bytes() and b"3" in ids
    source = UnitsSource(
        [u.staging for u in units], staged.lengths, unit_samples, [r["media"].pixel_offsets for r in results]
    )
    rng = np.random.default_rng(0)
    n = staged.num_samples
    for request in (np.arange(n), rng.permutation(n), np.array([n - 1, 0, 3, 3])):
        np.testing.assert_array_equal(source.gather_pixels(request), local.source().gather_pixels(request))


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 100])
def test_write_ranges_cover_every_row_once_balanced_by_tokens(parts):
    rng = np.random.default_rng(parts)
    plan = plan_rows(rng.integers(1, 64, 500), max_seq_len=64)
    ranges = split_rows(plan, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == plan.num_rows and len(ranges) <= parts
    assert all(a < b for a, b in ranges) and all(r[1] == s[0] for r, s in pairwise(ranges))
    tok = plan.row_token_offsets()
    sizes = [tok[b] - tok[a] for a, b in ranges]
    if parts <= 7:  # each range within one row's worth of tokens of an equal share
        assert max(sizes) - plan.num_tokens / len(ranges) <= 64


def test_importing_the_engine_loads_no_ray_and_no_transformers():
    code = (
        "import sys, sftpack.offline, sftpack.offline._ray, sftpack.offline.engine; "
        "print(','.join(m for m in ('ray', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""
