"""Numba's on-disk cache never serves a kernel compiled against older helpers.

Numba checks a cached kernel against the file that defines it only;
:func:`sftpack.binpack._kernels.load` ties every kernel's cache to one digest of
all the kernel modules' sources. Checked end to end on a copy of the package
(so the edit never touches the checkout) with its own ``NUMBA_CACHE_DIR``: a
kernel of :mod:`._kernels_next` compiles and is cached, a helper it calls in
:mod:`._kernels_common` is edited, and a fresh process must run the edited
helper (a stale cached kernel would still return the old bins). Where the
digest cannot stand for the code in memory (sources edited after import) or
numba lacks the stamp it extends, the kernels compile without the disk cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import sftpack

PROBE = textwrap.dedent(
    """
    import json
    import sftpack.binpack as bp

    k = bp._kernels
    k.FORCE = "compiled"  # small inputs would run as plain Python
    assert k.__file__.startswith(%r), k.__file__  # the copy, not the checkout
    try:
        bins = bp.pack([3, 4, 5, 6], 8, "greedy_knapsack")
        result = [[int(i) for i in b] for b in bins]
    except ValueError as e:
        result = "ValueError: " + str(e)
    d = k.greedy_records
    print(json.dumps({
        "result": result,
        "dispatcher": type(d).__name__,
        "hits": sum(d.stats.cache_hits.values()),
        "misses": sum(d.stats.cache_misses.values()),
    }))
    """
)

# greedy_records (in _kernels_next) writes its records with _record (in _kernels_common)
HELPER = '''    """Append record ``nr``: bins ``a..b-1`` each take ``j`` items of size rank ``s`` after ``f``."""
'''
EDITED = HELPER + '    if nr >= 0:\n        raise ValueError("edited _record")\n'


def run_probe(src: Path, cache_dir: Path) -> dict:
    env = dict(os.environ)
    env["NUMBA_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE % str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=src,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_editing_a_helper_recompiles_the_kernels_of_other_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(Path(sftpack.__file__).parent, src / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "numba_cache"

    first = run_probe(src, cache)
    assert first["dispatcher"] == "CPUDispatcher"
    assert first["result"] == [[3], [2, 0], [1]]
    assert (first["hits"], first["misses"]) == (0, 1)  # compiled, then saved

    again = run_probe(src, cache)  # nothing edited: served from the cache
    assert again == {**first, "hits": 1, "misses": 0}

    common = src / "sftpack" / "binpack" / "_kernels_common.py"
    text = common.read_text()
    assert text.count(HELPER) == 1
    common.write_text(text.replace(HELPER, EDITED))

    edited = run_probe(src, cache)  # the stale cached greedy_records would still return the bins
    assert edited["result"] == "ValueError: edited _record"
    assert (edited["hits"], edited["misses"]) == (0, 1)

    common.write_text(text)  # back to the first sources: their cache entry is valid again
    restored = run_probe(src, cache)
    assert restored["result"] == first["result"]


EDITED_AFTER_IMPORT = textwrap.dedent(
    """
    import json, pathlib, warnings
    import sftpack.binpack as bp

    k = bp._kernels
    assert k.__file__.startswith(%r), k.__file__
    two = pathlib.Path(k.__file__).with_name("_kernels_two.py")
    two.write_text(two.read_text() + "\\n# edited after import\\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k.load()
    print(json.dumps({
        "warnings": [str(w.message) for w in caught],
        "caches": sorted({type(getattr(k, n)._cache).__name__ for n in k._KERNELS}),
    }))
    """
)


def test_sources_edited_after_import_compile_uncached(tmp_path: Path) -> None:
    """The code in memory no longer matches the files the digest would hash: no disk cache."""
    src = tmp_path / "src"
    shutil.copytree(Path(sftpack.__file__).parent, src / "sftpack", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba_cache"), "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", EDITED_AFTER_IMPORT % str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=src,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["caches"] == ["NullCache"]
    assert len(seen["warnings"]) == 1 and "changed on disk since import" in seen["warnings"][0]


def test_without_an_index_stamp_the_cache_is_not_used() -> None:
    from sftpack.binpack import _kernels

    assert not _kernels._tie_to_sources(object(), "digest")  # load() then compiles uncached
    index = types.SimpleNamespace(_source_stamp=b"file")
    dispatcher = types.SimpleNamespace(_cache=types.SimpleNamespace(_cache_file=index))
    assert _kernels._tie_to_sources(dispatcher, "digest")
    assert index._source_stamp == (b"file", "digest")


def test_the_digest_covers_every_kernel_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from sftpack.binpack import _kernels

    names = [os.path.basename(path) for path in _kernels._source_files()]
    assert names == sorted(["_kernels.py", *(m.__name__.rsplit(".", 1)[1] + ".py" for m in _kernels._FAMILIES)])
    digest = _kernels._sources_digest()
    assert digest is not None and len(digest) == 64
    assert _kernels._sources_digest() == digest
    assert _kernels._IMPORTED_STAMPS is not None
    monkeypatch.setattr(_kernels, "_IMPORTED_STAMPS", (*_kernels._IMPORTED_STAMPS[:-1], ("changed", 0, 0)))
    assert _kernels._sources_digest() is None
