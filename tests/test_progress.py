"""sftpack's progress bars (:class:`sftpack._progress.Bar`) survive forked processes killed at any
point: a child killed while it held the bars' lock leaves the parent able to draw its next bar
(tqdm's own class, whose lock holds a semaphore shared across fork, hangs there: the control,
run in a subprocess with a timeout), and a lock the parent held at the fork is not inherited taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from sftpack._progress import Bar

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX only")

#: ample for making one disabled bar on a loaded machine; a hang never ends
WAIT = 60.0


def _bar_made_within(seconds: float) -> bool:
    done = threading.Event()

    def make() -> None:
        Bar(disable=True).close()
        done.set()

    threading.Thread(target=make, daemon=True).start()
    return done.wait(seconds)


def _killed_holding(lock_of) -> None:
    """Fork a child that takes ``lock_of()`` and is killed while it holds it; reap it."""
    pid = os.fork()
    if pid == 0:  # the child: take the lock, die holding it
        lock_of().acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)


def test_a_child_killed_holding_the_lock_leaves_the_parent_drawing():
    Bar(disable=True).close()  # the lock exists before the fork, as in a run
    _killed_holding(Bar.get_lock)
    assert _bar_made_within(WAIT)


def test_a_child_killed_holding_tqdms_own_lock_leaves_the_parent_drawing():
    """A library's bar in a forked child (plain tqdm): the child got a lock of its own at the fork."""
    from tqdm import tqdm

    tqdm(disable=True).close()
    _killed_holding(tqdm.get_lock)
    done = threading.Event()
    threading.Thread(target=lambda: (tqdm(disable=True).close(), done.set()), daemon=True).start()
    assert done.wait(WAIT)


def test_tqdm_itself_hangs_there():
    """The control: the same with tqdm's own bar class hangs the parent (a subprocess, timed out)."""
    code = (
        "import os, signal\n"
        "from tqdm import tqdm\n"
        "tqdm(disable=True).close()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    tqdm.get_lock().acquire(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.waitpid(pid, 0)\n"
        "tqdm(disable=True).close()\n"
        "print('drawn')\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], timeout=3, capture_output=True)


def test_a_lock_held_at_the_fork_is_not_inherited_taken():
    r, w = os.pipe()
    with Bar.get_lock():  # this thread holds it while forking
        pid = os.fork()
        if pid == 0:
            os.close(r)
            ok = _bar_made_within(WAIT)
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
