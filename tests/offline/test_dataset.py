"""PrepackedDataset: damaged directories, fingerprints, epochs, shards, DataLoader, exactness."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from sftpack import PackedBatch
from sftpack.chat import read_conversations, tokenize_conversations
from sftpack.exactness import TinyCausalLM, check_plain_model
from sftpack.offline import PrepackedDataset, PrepackError, prepack_samples
from sftpack.offline._format import FILES
from sftpack.testing import samples_from_lengths, tiny_chat_tokenizer

from .conftest import MAX_SEQ_LEN

# Rows read back vs each conversation alone, in float64 (u = 2**-53 = 1.1e-16): the
# same function in other summation orders, so each run is off by at most n*u of its
# terms' magnitude sum whatever the order (Higham, Accuracy and Stability, section
# 3.1). The longest chain of roundings here is n <= 4,000 (width 32, MLP 128, rows of
# 256, 284 logits, <= 1,280 targets, weight gradients summed over <= 256 tokens):
# 4.4e-13 relative a run, 8.9e-13 for two, on values of magnitude <= 10: 8.9e-12.
# 1e-10 is 11x that. A packing bug (cross-conversation attention) moves logits by > 1e-3.
EXACT_64 = 1e-10


@pytest.fixture
def copy(built, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(built[1], dst)
    return dst


# --------------------------------------------------------------------------- damage


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_is_caught_by_full_verification_naming_the_file(copy, name):
    path = copy / name
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte: past the header, in the data
    path.write_bytes(bytes(data))
    PrepackedDataset(copy, verify=None)  # same size: only the checksum sees it
    with pytest.raises(PrepackError, match=rf"{name} does not match its checksum"):
        PrepackedDataset(copy, verify="full")


def test_a_missing_renamed_or_truncated_file_is_named(copy):
    (copy / "loss_mask.npy").rename(copy / "loss_mask.old")
    with pytest.raises(PrepackError, match=r"loss_mask.npy is missing \(deleted or renamed\?\)"):
        PrepackedDataset(copy)
    (copy / "loss_mask.old").rename(copy / "loss_mask.npy")
    data = (copy / "tokens.npy").read_bytes()
    (copy / "tokens.npy").write_bytes(data[:-10])
    for verify in ("size", None):  # even unverified, a short file never maps
        with pytest.raises(PrepackError, match=r"tokens.npy is \d+ bytes, the manifest says \d+"):
            PrepackedDataset(copy, verify=verify)


def test_a_newer_format_a_foreign_directory_and_a_bad_manifest_are_refused(copy, tmp_path):
    m = json.loads((copy / "manifest.json").read_text())
    m["format_version"] = 6  # 4 is a prepack with media (tests/offline/test_media.py), 5 one with weights or pairs
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PrepackError, match=r"newer sftpack \(format version 6 > 5"):
        PrepackedDataset(copy)
    m["format_version"] = 1  # version 1 had no manifest checksum: refused with the fix
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(PrepackError, match=r"older sftpack \(format version 1 < 2.*no checksum: write it again"):
        PrepackedDataset(copy)
    (copy / "manifest.json").write_text("{oops")
    with pytest.raises(PrepackError, match="manifest.json is not valid JSON"):
        PrepackedDataset(copy)
    with pytest.raises(PrepackError, match=r"is not a sftpack prepack \(no manifest.json\)"):
        PrepackedDataset(tmp_path)
    with pytest.raises(PrepackError, match="no such directory"):
        PrepackedDataset(tmp_path / "nope")


# --------------------------------------------------------------------------- fingerprint


def test_expect_refuses_a_mismatched_trainer_naming_both_values(built, tok):
    out = built[1]
    PrepackedDataset(out, expect={"max_seq_len": MAX_SEQ_LEN, "pad_multiple": 4, "tokenizer": tok})
    with pytest.raises(PrepackError, match=r"max_seq_len=1024 but the trainer expects max_seq_len=2048"):
        PrepackedDataset(out, expect={"max_seq_len": 2048})
    with pytest.raises(PrepackError, match=r"pad_multiple=4 but the trainer expects pad_multiple=8"):
        PrepackedDataset(out, expect={"pad_multiple": 8})
    with pytest.raises(PrepackError, match="another tokenizer"):
        PrepackedDataset(out, expect={"tokenizer": tiny_chat_tokenizer("llama3")})
    with pytest.raises(ValueError, match="unknown keys"):
        PrepackedDataset(out, expect={"seq_len": 3})


# --------------------------------------------------------------------------- epochs and shards


def test_each_step_is_the_same_rows_for_any_world_dealt_once_each_by_cost(built):
    """The global stream: step s is positions [s*B, (s+1)*B) of the epoch's one order whatever the
    world size, every rank reads rows_per_rank of them (each once), and the rows left after the
    last full step are read by no rank this epoch."""
    out = built[1]
    full = PrepackedDataset(out)
    costs = full.row_costs()
    for per_rank in (1, 2):
        for epoch in (0, 1):
            stream = None
            for world in (1, 2, 3):
                shards = []
                for rank in range(world):
                    ds = PrepackedDataset(
                        out, shuffle=True, seed=7, rank=rank, world_size=world, rows_per_rank=per_rank
                    )
                    ds.set_epoch(epoch)
                    stream = ds.epoch_order() if stream is None else stream
                    np.testing.assert_array_equal(ds.epoch_order(), stream)  # one order for every world size
                    assert len(ds) == full.num_rows // (per_rank * world) * per_rank
                    shards.append(ds.epoch_rows().reshape(-1, per_rank))
                step = per_rank * world
                for s in range(full.num_rows // step):
                    got = np.stack([sh[s] for sh in shards])  # (world, per_rank): the ranks' rows of step s
                    assert sorted(got.ravel().tolist()) == sorted(stream[s * step : (s + 1) * step].tolist())
                    if world > 1:  # each rank's rows heaviest first (one rank: the stream's order)
                        assert all(np.all(np.diff(costs[line]) <= 0) for line in got)
                allrows = np.concatenate([sh.ravel() for sh in shards])
                assert len(set(allrows.tolist())) == len(allrows)  # no row twice in an epoch
                assert full.num_rows - len(allrows) < step  # only the last partial step's rows left
    a = PrepackedDataset(out, shuffle=True, seed=7)
    order0 = a.epoch_rows()
    a.set_epoch(1)
    assert not np.array_equal(order0, a.epoch_rows())
    a.set_epoch(0)
    assert np.array_equal(order0, a.epoch_rows())  # the order is a function of (seed, epoch)
    assert torch.equal(a[0].input_ids, full.row(int(order0[0])).input_ids)


def test_balance_is_the_old_name_of_cost(built):
    with pytest.warns(DeprecationWarning, match="balance= is deprecated.*use cost="):
        ds = PrepackedDataset(built[1], balance="attention")
    assert ds.cost.name == "attention"
    with pytest.raises(TypeError, match="give cost= only"):
        PrepackedDataset(built[1], cost="tokens", balance="tokens")
    with pytest.raises(ValueError, match="cost 'flops'"):
        PrepackedDataset(built[1], cost="flops")


def test_attention_cost_uses_squared_lengths(built):
    ds = PrepackedDataset(built[1], cost="attention")
    lens = ds.sequences["length"].astype(np.int64)
    r = ds.rows["sequence"]
    assert ds.row_costs()[0] == int((lens[r[0] : r[1]] ** 2).sum())
    assert ds.row_costs("tokens")[1] == int(lens[r[1] : r[2]].sum())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_collates_rows_end_to_end(built, workers):
    ds = PrepackedDataset(built[1])
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=workers, collate_fn=ds.collate)
    seen = 0
    for k, batch in enumerate(loader):
        assert isinstance(batch, PackedBatch)
        batch.validate()
        rows = [ds.row(i) for i in range(2 * k, min(2 * k + 2, len(ds)))]
        assert batch.num_tokens == MAX_SEQ_LEN * len(rows)
        assert torch.equal(batch.input_ids, torch.cat([r.input_ids for r in rows]))
        assert torch.equal(batch.labels, torch.cat([r.labels for r in rows]))
        seen += len(rows)
    assert seen == len(ds)


# --------------------------------------------------------------------------- exactness


def test_training_on_rows_read_back_equals_the_conversations_alone(chat_file, tok, tmp_path):
    from sftpack.offline import prepack

    # narrow rows keep the model runs cheap; split pieces still occur at this width
    out = prepack(chat_file, tmp_path / "p", tokenizer=tok, max_seq_len=256, pad_multiple=4, limit=24).path
    ds = PrepackedDataset(out)
    reference = {}
    for s in tokenize_conversations(
        read_conversations(chat_file, on_bad_row="skip"), tok, max_seq_len=256, overlong="split"
    ):
        reference.setdefault(s.conversation_id, []).append(s)
    model = TinyCausalLM(vocab_size=len(tok), seed=0, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model: one thread is faster than two fighting over a busy machine
    try:
        _check_row_exactness(ds, reference, model)
    finally:
        torch.set_num_threads(threads)


def _check_row_exactness(ds, reference, model):
    # a row of several conversations (one of them possibly a split piece)
    i = next(k for k in range(len(ds)) if 3 <= ds[k].num_sequences <= 5)
    row = ds[i]
    assert row.num_sequences >= 3
    samples = [reference[cid][int(rec["piece"])] for cid, rec in zip(row.sequence_ids, ds.row_sequences(i))]
    for pad_between in (True, False):
        rep = check_plain_model(model, samples, row, pad_between_seqs=pad_between)
        assert rep.within(EXACT_64, EXACT_64, EXACT_64), rep
        assert rep.num_label_tokens == row.num_label_tokens > 0
    # negative control: the same row run as one causal sequence must fail, by far more than the tolerance
    bad = check_plain_model(model, samples, row, contaminate=True)
    assert bad.max_logit_diff > 1e-3, bad


def test_rows_read_back_equal_the_contract_row_of_their_samples():
    samples = samples_from_lengths([5, 10])
    import tempfile

    out = prepack_samples(samples, tempfile.mkdtemp() + "/ab", max_seq_len=16).path
    row = PrepackedDataset(out)[0]
    want = PackedBatch.from_samples(samples, max_seq_len=16)
    for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded"):
        assert torch.equal(getattr(row, f), getattr(want, f)), f
    assert row.max_seqlen == want.max_seqlen and row.sequence_ids == (0, 1)
