"""One private local Ray for the whole folder (starting it costs 15-25 s on 2 cores),
a hard timeout on every test (a starved Ray pipeline hangs instead of failing), and
small chat inputs: three JSONL files of real conversations with known bad rows."""

from __future__ import annotations

import json
import signal

import pytest

from sftpack.data import default_corpus
from sftpack.testing import tiny_chat_tokenizer

#: seconds any one test (or the Ray start) may take before it fails instead of hanging: a hang
#: guard, not a speed check. The slowest Ray test takes about a minute on an idle 2-core machine
#: and three times that with both cores busy with other work; 600 s bounds a hang with room for
#: a heavily loaded machine.
TIMEOUT_S = 600
#: bad rows put in the second file, each with the reason the reader counts it under
BAD_ROWS = [("{not json", "invalid_json"), ('{"messages": []}', "empty_messages")]
FILES = 3
PER_FILE = 30


class _Timeout(Exception):
    pass


@pytest.fixture(autouse=True)
def hard_timeout():
    """SIGALRM after TIMEOUT_S: the test fails (and the session fixture still shuts Ray down)."""

    def fire(signum, frame):
        raise _Timeout(f"a Ray test ran over {TIMEOUT_S} s: a hung pipeline (starved CPUs?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session")
def ray_cluster():
    """A private Ray: 3 logical CPUs (2 actors + 1 spare), 1 GiB object store, a short
    temp root under /tmp (pytest's tmp_path is too long for Ray's Unix sockets)."""
    from sftpack.offline.engine import ray_session

    def fire(signum, frame):
        raise _Timeout(f"starting Ray took over {TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(TIMEOUT_S)
    try:
        session = ray_session(num_cpus=3)
        started = session.__enter__()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    try:
        yield started
    finally:
        session.__exit__(None, None, None)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """The offline tiny ChatML tokenizer saved as a folder, as a cluster would get it."""
    path = tmp_path_factory.mktemp("tok") / "chatml"
    tiny_chat_tokenizer("chatml").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_dir(tmp_path_factory):
    """A folder of FILES JSONL files (read in sorted order); the second holds BAD_ROWS."""
    root = tmp_path_factory.mktemp("chats")
    convs = list(default_corpus(limit=FILES * PER_FILE))
    for k in range(FILES):
        lines = [json.dumps({"messages": c.messages}) for c in convs[k * PER_FILE : (k + 1) * PER_FILE]]
        if k == 1:
            lines[5:5] = [row for row, _ in BAD_ROWS]
        (root / f"part-{k}.jsonl").write_text("\n".join(lines) + "\n")
    return root
