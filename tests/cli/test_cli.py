"""The command line: map (text and PNG), demo, help."""

from __future__ import annotations

import re

import pytest

from sftpack.cli import main
from sftpack.report.layout import worked_example


def test_help_lists_commands(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    # docs/contract.md section 3: the help lists every command, in the map's order.
    listed = [line.split()[0] for line in out.splitlines() if line[:4] == "    " and line[4:5].strip()]
    assert listed == ["prepack", "inspect", "train", "verify", "map", "demo", "bench", "plan"]


def test_map_prints_worked_example(capsys, tmp_path):
    png = tmp_path / "map.png"
    assert main(["map", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 5, 16]" in out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 36]" in out
    assert "cu_seqlens=[0, 5, 15]  cu_seqlens_padded=[0, 8, 20]" in out
    assert "A A A A A . . . |B B B B B B B B B B . ." in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worked_example_rows_validate():
    rows = worked_example()
    assert [r.path for r in rows] == ["offline", "loader", "trainer"]
    for r in rows:
        r.batch.validate()
        assert r.batch.cu_seqlens.tolist() == [0, 5, 15]


def _chat_file(tmp_path):
    import json

    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for i in range(1, 40):
            msgs = [{"role": "user", "content": "hi " * i}, {"role": "assistant", "content": "yo " * (2 * i)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
        f.write("{not json\n")
    return path


def test_bench_reports_layouts_and_counts_bad_rows(capsys, tmp_path):
    from sftpack.testing import tiny_chat_tokenizer

    tok_dir = tmp_path / "tok"
    tiny_chat_tokenizer("chatml").save_pretrained(tok_dir)
    path = _chat_file(tmp_path)
    assert main(["bench", str(path), "--tokenizer", str(tok_dir), "--max-seq-len", "128", "--pad-multiple", "4"]) == 0
    out = capsys.readouterr().out
    assert "read 40 rows: 39 kept, dropped: invalid_json 1" in out
    assert "39 conversations ->" in out
    for layout in ("bfd", "ffd", "first_fit_shuffle", "next_fit", "greedy_knapsack", "one per row, padded to 128"):
        assert f"\n  {layout} " in out
    assert "lower bounds on rows: L1=" in out
    # the packers' first call (their kernels' load) apart from their packing time
    assert re.search(r"\n  compiler load \(each packer's first call, once per process; not in pack time\): bfd ", out)


def test_bench_error_mode_names_file_and_line(tmp_path, capsys):
    import pytest

    from sftpack.testing import tiny_chat_tokenizer

    tok_dir = tmp_path / "tok"
    tiny_chat_tokenizer("chatml").save_pretrained(tok_dir)
    path = _chat_file(tmp_path)
    # A data error: one line naming the file and the line, exit status 1, no traceback.
    assert main(["bench", str(path), "--tokenizer", str(tok_dir), "--on-bad-row", "error"]) == 1
    err = capsys.readouterr().err
    assert re.match(r"sftpack bench: .*chat.jsonl, line 40: invalid JSON", err) and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    # A usage error: exit status 2.
    assert main(["bench", str(path), "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "sftpack bench: cannot load a tokenizer" in capsys.readouterr().err
    # --debug shows the real exception instead.
    with pytest.raises(ValueError, match="line 40: invalid JSON"):
        main(["--debug", "bench", str(path), "--tokenizer", str(tok_dir), "--on-bad-row", "error"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--max-seq-len", "0"], "argument --max-seq-len: must be a positive integer, got 0"),
        (["bench", "--max-seq-len", "-5"], "argument --max-seq-len: must be a positive integer, got -5"),
        (["bench", "--pad-multiple", "0"], "argument --pad-multiple: must be a positive integer"),
        (["bench", "--num-proc", "0"], "argument --num-proc: must be a positive integer"),
        (["bench", "--limit", "0"], "argument --limit: must be a positive integer, got 0"),
        (["bench", "--max-seq-len", "x"], "'x' is not an integer"),
        (["bench", "--max-seq-len", "1000", "--pad-multiple", "3"], "not a multiple of --pad-multiple 3 (use 999)"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        rc = main(argv)
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_unwritable_png_is_a_one_line_data_error(capsys, tmp_path):
    assert main(["map", "--png", str(tmp_path / "missing" / "map.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sftpack map: ") and "missing" in err and "check that the path exists" in err
    assert len(err.strip().splitlines()) == 1


def test_bench_reports_every_file_it_did_not_read(capsys, tmp_path):
    from sftpack.testing import tiny_chat_tokenizer

    tok_dir = tmp_path / "tok"
    tiny_chat_tokenizer("chatml").save_pretrained(tok_dir)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    _chat_file(data / "sub")  # 39 good rows and one bad one, one folder down
    (data / "notes.txt").write_text("not a chat file\n")
    assert main(["bench", str(data), "--tokenizer", str(tok_dir)]) == 0
    out = capsys.readouterr().out
    assert "read 40 rows: 39 kept, dropped: invalid_json 1" in out
    assert "not read: unsupported_format 1" in out and "notes.txt: unsupported_format" in out


def test_image_prepack_says_when_the_patch_budget_limits_the_fill(capsys, tmp_path):
    import json

    from sftpack.cli._prepack import patch_budget_note

    out_dir = tmp_path / "vqa.prepack"
    argv = ["prepack", "--corpus", "vqa", "--limit", "16", "--max-patches-per-row", "1024"]
    assert main([*argv, "--out", str(out_dir)]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"tokenize: 100%\|.*\| 16/16 \[", err)  # the tokenize bar knows its total
    # 16 conversations of a few dozen tokens fill few of 4,096 slots while their patches fill the rows
    line = next(x for x in out.splitlines() if x.strip().startswith("patch budget"))
    assert re.search(r"fill \d+\.\d%: rows close on --max-patches-per-row \(1,024 patches; \d+\.\d% of it", line)
    assert "before --max-seq-len (4,096 tokens)" in line and "raise --max-patches-per-row to fill rows" in line
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert patch_budget_note(manifest) is not None
    # the same rows under a budget they use little of: the tokens bind, no sentence
    fp = dict(manifest["fingerprint"], max_patches_per_row=10**6)
    assert patch_budget_note({**manifest, "fingerprint": fp}) is None
    no_budget = {k: v for k, v in manifest["fingerprint"].items() if k != "max_patches_per_row"}
    assert patch_budget_note({**manifest, "fingerprint": no_budget}) is None


def test_prepack_tokenize_bar_totals(tmp_path):
    """The rows stage 1 will read, counted without reading them: the tokenize bar's total and ETA."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftpack.chat import read_conversations
    from sftpack.data import default_corpus
    from sftpack.offline._local import input_total

    jsonl = _chat_file(tmp_path)  # 39 rows and a bad one: 40 lines
    bare = tmp_path / "bare.jsonl"
    bare.write_bytes(jsonl.read_bytes().rstrip(b"\n"))  # no newline after the last row
    table = pa.table({"messages": [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]] * 7})
    pq.write_table(table, tmp_path / "seven.parquet")
    reader = read_conversations([str(jsonl), str(bare), str(tmp_path / "seven.parquet")])
    assert input_total(None, reader, None) == 40 + 40 + 7
    assert input_total(None, reader, 50) == 50
    assert input_total([[], [], []], None, None) == 3
    assert input_total(iter([]), None, None) is None  # a stream: no total
    assert input_total(None, None, None) == sum(1 for _ in default_corpus())  # the embedded corpus
    assert input_total(None, None, 10) == 10
