"""sftpack._publish.Publish: whole or absent, nothing left behind, "already there" as asked."""

from __future__ import annotations

import pytest

from sftpack._publish import Publish


def test_a_folder_appears_whole_and_its_temporary_is_gone(tmp_path):
    dest = tmp_path / "entry"
    with Publish(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-entry-") and not dest.exists()
        (tmp / "a").write_text("1")
    assert (dest / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_a_failed_body_leaves_nothing_and_the_error_goes_on(tmp_path):
    for folder in (True, False):
        with pytest.raises(ZeroDivisionError), Publish(tmp_path / "x", folder=folder):
            raise ZeroDivisionError("the writer failed")
    assert list(tmp_path.iterdir()) == []


def test_a_file_replaces_a_file_and_a_named_temporary_is_used(tmp_path):
    dest = tmp_path / "latest"
    dest.write_text("old")
    with Publish(dest, folder=False, tmp=tmp_path / "latest.tmp") as tmp:
        tmp.write_text("new")
    assert dest.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_folder_already_there_is_kept_or_refused(tmp_path):
    dest = tmp_path / "entry"
    dest.mkdir()
    (dest / "theirs").write_text("first")
    mine = Publish(dest, keep_existing=True)
    (mine.tmp / "mine").write_text("second")
    assert mine.publish() is False and sorted(p.name for p in dest.iterdir()) == ["theirs"]
    with pytest.raises(OSError), Publish(dest) as tmp:
        (tmp / "mine").write_text("third")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
