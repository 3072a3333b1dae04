"""What the publish step accepts at ``--out`` before any work (``_publish.check_target``),
and that a failed run's partial folder goes, unlike a live run's."""

from __future__ import annotations

import os

import pytest

from sftpack.offline import PrepackError
from sftpack.offline._publish import check_target, partial_dir, writing


def test_what_an_existing_output_may_be(built, tmp_path):
    assert check_target(tmp_path / "new", overwrite=False) is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrepackError, match="exists and is not a folder"):
        check_target(tmp_path / "file", overwrite=True)
    (tmp_path / "empty").mkdir()
    st = os.stat(tmp_path / "empty")
    assert check_target(tmp_path / "empty", overwrite=False) == (st.st_dev, st.st_ino)
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(PrepackError, match="exists and is not a folder"):
        check_target(tmp_path / "link", overwrite=True)
    with pytest.raises(PrepackError, match=r"already exists \(a prepack\): pass --overwrite"):
        check_target(built[1], overwrite=False)
    assert check_target(built[1], overwrite=True) is not None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(PrepackError, match="already exists: pass --overwrite"):
        check_target(tmp_path / "mine", overwrite=False)


def test_a_failed_run_removes_its_partial_folder_and_keeps_a_live_runs(tmp_path):
    out = tmp_path / "p"
    live = partial_dir(out)  # this process's: alive
    live.mkdir()
    with pytest.raises(RuntimeError, match="boom"), writing(out, overwrite=False) as output:
        assert output.tmp.is_dir() and output.tmp.name.startswith(".p.sftpack-partial-")
        raise RuntimeError("boom")
    assert not output.tmp.exists() and live.is_dir() and not out.exists()
