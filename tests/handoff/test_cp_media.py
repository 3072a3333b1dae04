"""Context parallelism on packed rows with images and videos: the shard's media, and CP=2 equal to CP=1.

Two rows, each sequence padded to a multiple of 2*CP = 4:

- ``images``: five easy-vqa samples (one or two images each, runs of 4 to 16 placeholders)
  and a text-only one, on a tiny Qwen2-VL;
- ``videos``: the hand-made samples of tests/multimodal/test_video.py (text-only, image-only,
  video-only and mixed; 7 items, 4 of them videos), on a tiny Qwen2.5-VL (window attention
  in the tower, time-scaled temporal positions).

Under CP=2 at least two items of each row are cut between the ranks and two lie wholly on
one (asserted), so both what a rank holds of an item and the map from its placeholders to
the item's features matter.

What a rank computes (``sftpack.multimodal._cp.cp_hidden``): the vision tower over the items
its placeholders reach (whole items), their features picked by ``shard.feature_index``, the
language model over its tokens with the MRoPE positions at its slots, and attention on local
queries against every rank's keys and values (all-gathered with the autograd all-gather of
tests/consumers/test_distributed.py; the same block-causal rule as its reference, plus the
``padded`` boundary mode). The loss is each shard's token-mean share over the row's count
of targets, summed over the two ranks; gradients are summed over the ranks.

CP=1 is the unsharded row through the family's packed forward (sftpack's varlen training
attention), which tests/multimodal/test_exactness.py proves equal to each sample alone.

Tolerance, fixed: 1e-10 in float64, derived as in tests/multimodal/test_exactness.py (the
same function in other summation orders; the longest chain of roundings n <= 4,000 terms
here too: 1,176-term patch dot products, attention over <= 440 keys (the longer row), of
which the masked ones add exact zeros; n*u = 4.4e-13 relative per run on values of magnitude <= 10, asserted:
<= 8.9e-12 between two runs), plus one rounding per gradient entry from summing the two
ranks' shares (2.2e-15 on magnitude <= 10); 1e-10 is 11x the bound. Negative controls, each
moving the logits by more than BUG = 1e-4 (1e6 x TOL): features scattered in the held
items' order without the slot map, and MRoPE positions sliced as a contiguous range of
slots instead of the rank's chunks. The shard layer is checked exactly: each rank's
``feature_index`` against the global ordinal of each of its placeholders, and the shards put
back together (``unshard_cp``) against the row, media included.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sftpack import PackedBatch, Sample
from sftpack.handoff import PackedBatchError, pad_multiple_for, shard_for_cp, unshard_cp
from sftpack.handoff.slots import slot_layout
from sftpack.loss import count_label_tokens, token_mean_loss
from sftpack.multimodal import family_for, tokenize_media_conversations, vqa_corpus
from sftpack.multimodal._cp import cp_hidden
from tests.consumers.test_distributed import _AllGather
from tests.loop.conftest import run_ranks
from tests.multimodal.conftest import Renumbered
from tests.multimodal.test_video import IDS, PAD, VOCAB, _items, _sample

CP = 2
TOL = 1e-10  # float64; see the docstring
BUG = 1e-4
CP_ATTENTION = "sftpack_cp_gloo_reference"
MODES = {"real": True, "padded": False}


# ---------------------------------------------------------------- the rows
def _row(samples: list[Sample], pad_id: int) -> PackedBatch:
    return PackedBatch.from_samples(samples, pad_multiple=pad_multiple_for(cp_size=CP).seq_multiple, pad_id=pad_id)


@pytest.fixture(scope="module")
def rows():
    """name -> (the family's tiny float64 model, given its text attention; the row)."""
    torch.set_num_threads(1)  # tiny matmuls; and the ranks are forked from this process
    fam = family_for("qwen2_vl")
    convs = list(vqa_corpus(seed=2, limit=5, min_side=56, max_side=112))
    samples = list(tokenize_media_conversations(convs, tokenizer=fam.tokenizer(), processor=fam.image_processor()))
    rn = Renumbered(samples)
    first = rn.samples[0]
    end = int(first.media.slots[0].sum())  # text after sample 0's only image: a text-only sample
    text = Sample(first.input_ids[end : end + 15], first.loss_mask[end : end + 15], "text-only")
    images = _row([*rn.samples[:2], text, *rn.samples[2:]], rn.pad_id).validate()
    fam25 = family_for("qwen2_5_vl")
    videos = _row([_sample(fam25, items, seed, f"s{seed}") for seed, items in enumerate(_items())], PAD).validate()
    assert videos.media.num_videos >= 2
    return {
        "images": (lambda text_attention=None: rn.model(text_attention=text_attention), images),
        "videos": (
            lambda text_attention=None: fam25.tiny_model(
                vocab_size=VOCAB, token_ids=IDS, dtype=torch.float64, text_attention=text_attention
            ),
            videos,
        ),
    }


@pytest.mark.parametrize("name", ["images", "videos"])
def test_media_shards_hold_their_items_and_reassemble(rows, name):
    _, row = rows[name]
    shards = [shard_for_cp(row, CP, r).validate() for r in range(CP)]
    # the row's placeholders (images' and videos'), in row order, each one's ordinal: what its feature is
    is_ph = torch.isin(row.input_ids, torch.tensor([row.media.token_id, row.media.video_token_id or -1]))
    ordinal = torch.full_like(row.input_ids, -1)
    ordinal[is_ph] = torch.arange(int(is_ph.sum()))
    runs = row.media.slots
    feature_start = torch.cumsum(runs[:, 1], 0) - runs[:, 1]
    holders = torch.zeros(row.num_media_items, dtype=torch.int64)
    for s in shards:
        held = s.media_items
        holders[held] += 1
        assert torch.equal(s.media.grid_thw, row.media.grid_thw[held])
        assert torch.equal(s.media.slots, runs[held])
        # the held items' features laid end to end, picked by feature_index: the rank's placeholders' own
        features = torch.cat(
            [torch.arange(a, a + n) for a, n in zip(feature_start[held].tolist(), runs[held, 1].tolist())]
        )
        assert torch.equal(features[s.feature_index], ordinal[s.slot_index][s.placeholder_mask])
        assert torch.equal(s.media.video, row.media.video[held])
        assert torch.equal(s.media.positions, row.media.positions[:, s.slot_index])
        kw = s.media.hf_kwargs(s.position_ids)
        assert kw["position_ids"].shape == (4, 1, row.num_tokens // CP)
    assert int((holders == 2).sum()) >= 2, holders  # items cut between the ranks
    assert int((holders == 1).sum()) >= 2, holders  # and items wholly on one rank
    back = unshard_cp(shards).validate()
    for field in ("pixel_values", "slots", "sequence", "grid_thw", "positions", "video", "second_per_grid_ts"):
        assert torch.equal(getattr(back.media, field), getattr(row.media, field)), field
    assert back.media.video_token_id == row.media.video_token_id
    one = shard_for_cp(row, 1, 0).validate()
    assert torch.equal(one.media_items, torch.arange(row.num_media_items))
    assert torch.equal(one.feature_index, torch.arange(row.media.num_placeholders))


def test_media_shard_validation_names_the_field(rows):
    _, row = rows["images"]
    s = shard_for_cp(row, CP, 1)
    with pytest.raises(
        PackedBatchError, match=rf"CPShard.feature_index = \[{int(s.feature_index[0]) + 1}, .* does not "
    ):
        dataclasses.replace(s, feature_index=s.feature_index + 1).validate()
    with pytest.raises(PackedBatchError, match=rf"CPShard.media.positions has shape \(3, {row.num_tokens}\)"):
        dataclasses.replace(s, media=dataclasses.replace(s.media, positions=row.media.positions)).validate()
    fewer = dataclasses.replace(s.media, slots=s.media.slots[1:], sequence=s.media.sequence[1:])
    with pytest.raises(PackedBatchError, match=rf"CPShard.media_items = .* must be the {s.media.num_items - 1} held"):
        dataclasses.replace(s, media=fewer).validate()
    build, _ = rows["images"]
    with pytest.raises(ValueError, match="cp_hidden: the language model runs 'sftpack_varlen_train', which sees each"):
        cp_hidden(build(), s)  # its attention would treat each local segment as a whole sequence


# ---------------------------------------------------------------- CP=2 against CP=1
def cp_reference_attention(q, k, v, shard, *, real_mode: bool = True, scale: float | None = None):
    """Context-parallel attention of one rank, THD: local queries ``(T/CP, Hq, D)`` against every
    rank's keys and values (``(T/CP, Hkv, D)`` each, all-gathered with autograd and put in row
    order), under the row's block-causal rule: same segment, key position <= query position; in
    the ``real`` mode real keys only and zero output on padding, as the varlen reference."""
    cup = shard.global_cu_seqlens_padded
    cp = shard.cp_size
    k_all, v_all = (unshard_cp(_AllGather.apply(t.contiguous()), cup, cp) for t in (k, v))
    seg, pos, real = slot_layout(shard.global_cu_seqlens, cup, int(cup[-1]))
    allowed = (seg[None, :] == seg[shard.slot_index][:, None]) & (pos[None, :] <= shard.position_ids[:, None])
    if real_mode:
        allowed &= real[None, :]
    rep = q.shape[1] // k.shape[1]
    k_all, v_all = (t.transpose(0, 1).repeat_interleave(rep, dim=0) for t in (k_all, v_all))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k_all, v_all, attn_mask=allowed, scale=scale)
    out = out.transpose(0, 1)
    return out * real[shard.slot_index].view(-1, 1, 1).to(out.dtype) if real_mode else out


def _cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """:func:`cp_reference_attention` as a Hugging Face attention (``(1, H, T/CP, D)`` in,
    ``(1, T/CP, H, D)`` out), its shard and mode from the call's keyword arguments."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = cp_reference_attention(q, k, v, kw["sftpack_cp_shard"], real_mode=kw["sftpack_cp_real"], scale=scaling)
    return out.unsqueeze(0), None


def _register() -> None:
    import transformers
    from transformers import masking_utils

    transformers.AttentionInterface.register(CP_ATTENTION, _cp_attention)
    masking_utils.AttentionMaskInterface.register(CP_ATTENTION, lambda *args, **kwargs: None)


def _gathered(t: torch.Tensor, row: PackedBatch) -> torch.Tensor:
    return unshard_cp(_AllGather.apply(t.contiguous()), row, CP)


def _worker(rank: int, init_file: str, out_file: str, build, row: PackedBatch) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=CP, timeout=timedelta(seconds=300)
    )
    try:
        _register()
        model = build(text_attention=CP_ATTENTION)
        shard = shard_for_cp(row, CP, rank).validate()
        n = count_label_tokens(shard)  # summed over the CP group: the row's count
        result: dict = {}
        for mode, real in MODES.items():
            model.zero_grad(set_to_none=True)
            logits = model.lm_head(cp_hidden(model, shard, sftpack_cp_shard=shard, sftpack_cp_real=real))
            loss = token_mean_loss(logits, shard, n)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                grads[name] = g
            result[mode] = {"logits": _gathered(logits.detach(), row), "loss": total, "grads": grads}
        # Negative controls (forward only): features in the held items' order without the slot
        # map; MRoPE positions of a contiguous range of slots instead of the rank's chunks.
        no_map = dataclasses.replace(shard, feature_index=torch.arange(shard.feature_index.shape[0]))
        T_l = shard.num_tokens
        sliced = row.media.positions[:, rank * T_l : (rank + 1) * T_l]
        contiguous = dataclasses.replace(shard, media=dataclasses.replace(shard.media, positions=sliced))
        with torch.no_grad():
            for name, bad in (("no_slot_map", no_map), ("contiguous_positions", contiguous)):
                lg = model.lm_head(cp_hidden(model, bad, sftpack_cp_shard=shard, sftpack_cp_real=True))
                result[name] = _gathered(lg, row)
        if rank == 0:
            torch.save(result, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _reference(build, row: PackedBatch, real: bool) -> dict:
    """CP=1: the unsharded row through the family's packed forward (varlen training attention)."""
    model = build()
    fam = family_for(model)
    logits = fam.packed_logits(model, row, pad_between_seqs=real)
    loss = token_mean_loss(logits, row, row.num_label_tokens)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads}


@pytest.mark.parametrize("name", ["images", "videos"])
def test_cp2_equals_cp1(rows, name, tmp_path):
    build, row = rows[name]
    out = tmp_path / "cp.pt"
    run_ranks(_worker, (str(tmp_path / "init"), str(out), build, row), CP)
    got = torch.load(out)
    real = row.real_token_mask
    diffs, refs = {}, {mode: _reference(build, row, flag) for mode, flag in MODES.items()}
    for mode in MODES:
        want, have = refs[mode], got[mode]
        assert float(want["logits"][real].abs().max()) < 10  # the premise of TOL
        assert max(float(g.abs().max()) for g in want["grads"].values()) < 10
        assert want["grads"].keys() == have["grads"].keys()
        grad = {"vision": 0.0, "language": 0.0}
        for name, g in want["grads"].items():
            part = "vision" if ".visual." in name else "language"
            grad[part] = max(grad[part], float((g - have["grads"][name]).abs().max()))
        diffs[mode] = {
            "logits": float((want["logits"] - have["logits"]).abs().max()),  # every slot, padding too
            "loss": abs(float(want["loss"]) - float(have["loss"])),
            **grad,
        }
    print("CP=2 vs CP=1:", diffs)
    # the boundary mode reaches the attention: padding slots see their segment in 'padded', nothing in 'real'
    assert float((got["real"]["logits"][~real] - got["padded"]["logits"][~real]).abs().max()) > BUG
    for mode, d in diffs.items():
        assert all(v <= TOL for v in d.values()), (mode, d)  # written so that a NaN fails
    ref_logits = refs["real"]["logits"][real]
    for name in ("no_slot_map", "contiguous_positions"):
        moved = float((got[name][real] - ref_logits).abs().max())
        print(f"negative control {name}: logits move by {moved:.2e}")
        assert moved > BUG, name


def test_a_rank_whose_slots_hold_no_placeholder_holds_no_item():
    """An image early in a long sample: rank 1's chunks hold none of its run, so rank 1 holds no item
    (no tower work, empty pixels) and the shards still put the row back together."""
    fam = family_for("qwen2_5_vl")
    image = next(x for kind, x in _items()[3] if kind == "image")
    sample = _sample(fam, [("text", 2), ("image", image), ("text", 60), ("answer", 10)], 1, "a")
    row = _row([sample], PAD).validate()
    s0, s1 = (shard_for_cp(row, CP, r).validate() for r in range(CP))
    assert s0.media_items.tolist() == [0] and s1.media_items.tolist() == []
    assert s1.media.num_items == 0 and s1.media.pixel_values.shape[0] == 0 and s1.feature_index.numel() == 0
    assert not bool(s1.placeholder_mask.any())
    assert torch.equal(unshard_cp([s0, s1]).validate().media.pixel_values, row.media.pixel_values)
