"""`sftpack prepack` and `sftpack inspect` from the command line."""

from __future__ import annotations

import json
import re

import pytest

from sftpack.cli import main
from sftpack.offline import PrepackedDataset


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(d)
    return d


def test_prepack_writes_a_directory_and_prints_the_summary(chat_file, tok_dir, tmp_path, capsys):
    out = tmp_path / "pp"
    args = [
        "prepack",
        str(chat_file),
        "--out",
        str(out),
        "--tokenizer",
        str(tok_dir),
        "--max-seq-len",
        "512",
        "--cp",
        "2",
    ]
    assert main(args) == 0
    text = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["pad_multiple"] == 4  # --cp 2: each sequence padded to 2*CP
    c = m["counts"]
    assert f"wrote {out}" in text
    assert re.search(rf"conversations read +{c['read']:,}\n", text)
    assert "empty_messages 1, invalid_json 1, no_assistant_turn 1" in text  # sorted by reason
    assert re.search(rf"\n  rows +{c['rows']:,} x 512 slots, pad multiple 4\n", text)
    assert "read_tokenize" in text and "pack" in text and "write" in text
    ds = PrepackedDataset(out, verify="full")
    assert len(ds) == c["rows"]
    # an existing output is refused, --overwrite replaces it
    assert main(args) == 1
    assert "already exists (a prepack): pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--no-progress"]) == 0
    assert (out / "tokens.npy").read_bytes() == (ds.path / "tokens.npy").read_bytes()


def test_prepack_usage_errors(chat_file, tok_dir, tmp_path, capsys):
    base = ["prepack", str(chat_file), "--out", str(tmp_path / "x"), "--tokenizer", str(tok_dir)]
    assert main(base + ["--max-seq-len", "1000", "--pad-multiple", "16"]) == 2
    assert "max_seq_len=1000 is not a multiple of pad_multiple=16" in capsys.readouterr().err
    assert main(base + ["--max-seq-len", "1000", "--cp", "2", "--fp8", "mxfp8"]) == 2
    assert (
        "not a multiple of 64, which every row needs with --cp 2 --tp 1 --fp8 mxfp8 (use 960)"
        in capsys.readouterr().err
    )
    assert main(base + ["--on-bad-row", "error"]) == 1
    err = capsys.readouterr().err
    assert "chat.jsonl" in err and "line 11" in err  # the first bad row, by file and line
    assert not (tmp_path / "x").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    assert (
        main(["prepack", str(chat_file), "--out", str(tmp_path / "other"), "--tokenizer", str(tok_dir), "--overwrite"])
        == 1
    )
    assert "is not a prepack" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_inspect_describes_draws_a_row_verifies_and_plots(built, tmp_path, capsys):
    out = built[1]
    png = tmp_path / "hist.png"
    ds = PrepackedDataset(out)
    i = next(k for k in range(len(ds)) if ds[k].num_sequences >= 2)
    assert main(["inspect", str(out), "--row", str(i), "--verify", "--png", str(png)]) == 0
    text = capsys.readouterr().out
    c = ds.manifest["counts"]
    assert f"{c['rows']:,} rows, fill {c['fill']:.3%}, L1 bound {c['l1']:,}" in text
    assert "row fill:" in text and "sequences per row:" in text
    assert "verified: every file matches its SHA-256 (6 files), and the manifest its own" in text
    row = ds.row(i)
    assert f"cu_seqlens={row.cu_seqlens.tolist()}" in text
    assert f"cu_seqlens_padded={row.cu_seqlens_padded.tolist()}" in text
    assert f"A: {row.sequence_ids[0]}" in text and "|B" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", str(out), "--row", str(len(ds))]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 1
    assert "is not a sftpack prepack (no manifest.json)" in capsys.readouterr().err


def test_inspect_draws_narrow_rows_one_cell_per_slot(tmp_path, capsys):
    import numpy as np

    from sftpack import Sample
    from sftpack.offline import prepack_samples

    a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
    b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
    out = prepack_samples([a, b], tmp_path / "ab", max_seq_len=16).path
    assert main(["inspect", str(out), "--row", "0"]) == 0
    text = capsys.readouterr().out
    assert "  A A A A A |B B B B B B B B B B ." in text  # the worked example, as sftpack map draws it
    assert "cu_seqlens=[0, 5, 15]" in text and "cu_seqlens_padded=[0, 5, 16]" in text


def test_inspect_draws_a_row_of_the_widest_allowed_prepack_without_laying_its_slots(tmp_path, capsys):
    """``--row`` reads the row's index and stored tokens only. A row of the widest allowed
    width (2**24 slots) built as tensors would take 2**24 x 8 bytes = 134 MB for input_ids
    alone (and as much for labels and position_ids); drawing it must stay far below: the
    bound, 16 MB, is one eighth of that single tensor."""
    import tracemalloc

    import numpy as np

    from sftpack import Sample
    from sftpack.offline import prepack_samples
    from sftpack.offline._format import MAX_ROW_WIDTH

    a = Sample(np.arange(1, 6), np.ones(5, bool), "A")
    b = Sample(np.arange(101, 111), np.ones(10, bool), "B")
    out = prepack_samples([a, b], tmp_path / "wide", max_seq_len=MAX_ROW_WIDTH, pad_multiple=4).path
    tracemalloc.start()
    try:
        assert main(["inspect", str(out), "--row", "0"]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = capsys.readouterr().out
    assert peak < 16 << 20, peak
    assert f"row 0: 2 sequences, 15 real tokens in {MAX_ROW_WIDTH:,} slots, 13 labels" in text
    assert "cu_seqlens=[0, 5, 15]" in text and f"cu_seqlens_padded=[0, 8, {MAX_ROW_WIDTH}]" in text
