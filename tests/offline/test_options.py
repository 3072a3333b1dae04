"""``PrepackOptions`` on its own: checked once in one place (one message per problem),
frozen, and the fingerprint it gives is what ``prepack`` writes; ``prepack(options=)``
writes what the keywords write."""

from __future__ import annotations

import dataclasses

import pytest

from sftpack.binpack import Algorithm
from sftpack.chat import OnBadRow, Overlong, TrainOn
from sftpack.offline import PrepackOptions, prepack

from .conftest import MAX_SEQ_LEN


def test_strings_become_enums_and_the_object_is_frozen():
    o = PrepackOptions(algorithm="ffd", overlong="truncate", train_on="last_assistant", on_bad_row="error")
    assert o.algorithm is Algorithm.FFD and o.overlong is Overlong.TRUNCATE
    assert o.train_on is TrainOn.LAST_ASSISTANT and o.on_bad_row is OnBadRow.ERROR
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.max_seq_len = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("engine", "spark", "engine='spark' is not valid: choose one of 'local', 'ray'"),
        ("algorithm", "best", "algorithm='best' is not valid"),
        ("max_seq_len", 4.0, "max_seq_len must be a positive integer, got 4.0"),
        ("pad_multiple", 3, "max_seq_len=4096 is not a multiple of pad_multiple=3"),
        ("seed", True, "seed must be a non-negative integer, got True"),
        ("overlong", "cut", "overlong='cut' is not valid"),
        ("train_on", "all", "train_on='all' is not valid"),
        ("on_bad_row", "ignore", "on_bad_row='ignore' is not valid"),
        ("limit", 0, "limit must be a positive integer, got 0"),
        ("num_proc", 0, "num_proc must be a positive integer"),
        ("workers", -1, "workers must be a positive integer"),
        ("unit_size", 0, "unit_size must be a positive integer"),
        ("write_tasks", 0, "write_tasks must be a positive integer"),
        ("actor_cpus", 0, "actor_cpus must be a positive number of CPUs, got 0"),
        ("ray_address", 6379, "ray_address must be a string"),
    ],
)
def test_each_bad_option_is_one_error_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        PrepackOptions(**{field: value})
    assert str(err.value).count("\n") == 0


def test_the_fingerprint_is_what_prepack_records(built):
    result, _ = built
    o = PrepackOptions(max_seq_len=MAX_SEQ_LEN, pad_multiple=4, overlong="split")
    written = result.manifest["fingerprint"]
    assert {k: written[k] for k in o.fingerprint()} == o.fingerprint()


def test_options_write_what_the_keywords_write_and_do_not_mix_with_them(chat_file, tok, tmp_path):
    kw = {"max_seq_len": 512, "pad_multiple": 8, "seed": 2, "algorithm": "ffd", "overlong": "truncate"}
    a = prepack(chat_file, tmp_path / "a", tokenizer=tok, **kw)
    b = prepack(chat_file, tmp_path / "b", tokenizer=tok, options=PrepackOptions(**kw))
    for name in ("tokens.npy", "sequences.npy", "rows.npy", "manifest.json"):
        assert (a.path / name).read_bytes() == (b.path / name).read_bytes(), name
    with pytest.raises(ValueError, match="prepack got options= and also max_seq_len, seed: set them in"):
        prepack(chat_file, tmp_path / "c", tokenizer=tok, options=PrepackOptions(), max_seq_len=512, seed=1)
    assert not (tmp_path / "c").exists()
