"""The Ray engine takes the run's ``on_bad_row`` to its tokenizer actors (issue 38, item 3): a row the
chat template refuses, one with no trainable token and a tool call the template does not write are
counted under their reasons and the rest packed, as the local engine does (the same manifest
counts); with ``on_bad_row="error"`` the run stops at the first, naming its file and line."""

from __future__ import annotations

import json

import pytest

from sftpack.chat import BadRowError
from sftpack.offline import prepack, prepack_ray
from sftpack.testing import tiny_chat_tokenizer
from tests.cli.test_bad_rows_every_command import GOOD, ROWS, SKIPPED, STRICT

OPTIONS = {"max_seq_len": 64, "overlong": "split"}


def test_ray_counts_the_tokenizers_bad_rows_as_the_local_engine_does(ray_cluster, tmp_path):
    tok = tiny_chat_tokenizer("chatml")
    tok.chat_template = STRICT
    tok.save_pretrained(tmp_path / "tok")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    local = prepack(data, tmp_path / "local", tokenizer=tok, on_bad_row="skip", **OPTIONS)
    ray = prepack_ray(data, tmp_path / "ray", tokenizer=str(tmp_path / "tok"), workers=1, on_bad_row="skip", **OPTIONS)
    assert ray.counts["dropped"] == SKIPPED == local.counts["dropped"]
    assert ray.counts["packed_conversations"] == GOOD == local.counts["packed_conversations"]
    assert ray.counts == local.counts
    with pytest.raises(BadRowError, match=rf"conversation '{data}:3': .*\[template_error\]"):
        prepack_ray(data, tmp_path / "never", tokenizer=str(tmp_path / "tok"), workers=1, on_bad_row="error", **OPTIONS)
    assert not (tmp_path / "never").exists()
