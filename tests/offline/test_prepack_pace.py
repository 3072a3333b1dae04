"""The prepack's files do not depend on how tokenizing is spread out: any process count,
any batch size, and the same bytes as samples tokenized one conversation at a time
(``encode_conversation``, the per-conversation reference) and written by ``prepack_samples``."""

from __future__ import annotations

import json

import pytest

from sftpack.chat import encode_conversation, read_conversations
from sftpack.offline import prepack, prepack_samples
from sftpack.offline._format import FILES
from sftpack.offline.engine import LocalEngine

from .conftest import MAX_SEQ_LEN


def _files(path):
    return {name: (path / name).read_bytes() for name in FILES}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, chat_file, tok):
    """Each conversation tokenized on its own, then packed: the old way, no batching, no workers."""
    samples = []
    for conv in read_conversations(chat_file, on_bad_row="skip"):
        enc = encode_conversation(conv, tok, max_seq_len=MAX_SEQ_LEN, overlong="split")
        samples.extend(enc.samples)
    assert len(samples) > 50
    out = tmp_path_factory.mktemp("reference") / "ref"
    prepack_samples(samples, out, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, tokenizer=tok)
    return _files(out)


@pytest.mark.parametrize(("num_proc", "batch_size"), [(1, 256), (1, 7), (2, 7), (3, 5)])
def test_the_files_are_the_reference_bytes_for_any_parallelism(
    reference, built, chat_file, tok, tmp_path, num_proc, batch_size
):
    out = tmp_path / "p"
    engine = LocalEngine(num_proc=num_proc, batch_size=batch_size)
    result = prepack(chat_file, out, tokenizer=tok, max_seq_len=MAX_SEQ_LEN, pad_multiple=4, engine=engine)
    got = _files(out)
    for name in FILES:
        assert got[name] == reference[name], name
    # the manifest too (counts, fingerprints of the tokenizer and the input) is the default run's
    _, default_out = built
    assert (out / "manifest.json").read_bytes() == (default_out / "manifest.json").read_bytes()
    assert result.manifest["fingerprint"]["tokenizer"]["vocab_size"] == len(tok)


def test_the_tokenizer_fingerprint_is_recorded_even_when_nothing_tokenizes(tmp_path, tok):
    """The fingerprint starts with the first sample; with none it still runs, and the
    prepack is refused for having nothing to pack, not for a missing fingerprint."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match="nothing to pack"):
        prepack(path, tmp_path / "out", tokenizer=tok, max_seq_len=64, engine=LocalEngine(batch_size=1))


def test_batch_size_is_checked(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        LocalEngine(batch_size=0)
