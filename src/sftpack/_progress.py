"""sftpack's progress bars: :class:`Bar`, tqdm's bar with a lock of this process only.

tqdm guards its bars with one lock per class that also holds a ``multiprocessing`` semaphore,
shared with every process forked after it was made, and starts a monitor thread that takes
that lock every few seconds. sftpack forks processes that make bars of their own (the
training run's tokenizer process, tokenizer and loader workers) and kills them when their
work is no longer wanted: one killed while it held the semaphore left it taken, and the
parent hung at its next bar (seen once in the test suite). A :class:`Bar` takes a plain
thread lock of its own process instead (made anew in a forked child, so a lock held in the
parent at the fork is not inherited taken) and runs no monitor thread (its job, a bar left
behind by a stalled iteration, does not arise here: every bar is closed by its owner). A
child forked from a process that imported this module also gives tqdm's own bars (those of
the libraries it calls) a lock of its own.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from weakref import WeakSet

from tqdm.auto import tqdm
from tqdm.std import tqdm as tqdm_std

__all__ = ["Bar"]


class Bar(tqdm):
    """tqdm's bar (as ``tqdm.auto`` picks it), its lock and its instances this process's alone,
    no monitor thread; ``Bar.write`` writes a line above the bars being drawn."""

    monitor_interval = 0
    _lock: Any = threading.RLock()
    _instances: WeakSet[Any] = WeakSet()


def _in_child() -> None:
    """In a forked child: a lock of its own for sftpack's bars, and for tqdm's own (the bars a
    library draws in a worker: a dataset's loading bar), so that a child killed while it held
    one never holds the parent's."""
    Bar._lock = threading.RLock()
    Bar._instances = WeakSet()
    tqdm_std.set_lock(threading.RLock())


os.register_at_fork(after_in_child=_in_child)
