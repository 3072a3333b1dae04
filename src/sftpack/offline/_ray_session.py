"""Ray for the Ray engine: the one place ``ray`` is imported, and a session that always ends.

``ray`` is an optional dependency (``pip install 'sftpack[ray]'``), so nothing in
:mod:`sftpack.offline` imports it at module level: :func:`import_ray` does, when an
engine needs it, with the install line if it is missing.

:func:`ray_session` starts a private local Ray with a short temporary root (the
Unix socket path limit is 107 bytes), an explicit object store and, from the
engine, one spare logical CPU beyond the actors (an actor pool that takes every
CPU starves Ray Data's own tasks and hangs), and always shuts it down. Starting
Ray and its actors costs seconds per run, so Ray pays off across nodes; on one
machine the local engine does the same work without that overhead.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import tempfile
from collections.abc import Iterator
from types import ModuleType

__all__ = ["import_ray", "node_label", "ray_session"]

#: Longest allowed Ray temp root: the session adds about 65 bytes before the 107-byte socket limit.
_MAX_TEMP_ROOT = 40


def import_ray() -> ModuleType:
    """``ray`` with ``ray.data`` loaded, or an ``ImportError`` with the install line."""
    try:
        import ray.data  # noqa: F401 - loads the submodule the engine uses as ray.data

        import ray  # optional: Ray (the ray extra) only for engine='ray'
    except ImportError as e:
        raise ImportError(
            f"the Ray engine needs Ray Data ({e}): pip install 'sftpack[ray]', or use engine='local'"
        ) from e
    return ray


def node_label() -> str:
    """This process's Ray node id (12 characters), or the host name outside Ray: only a label."""
    try:
        return import_ray().get_runtime_context().get_node_id()[:12]
    except Exception:  # noqa: BLE001 - only a label
        return socket.gethostname()


@contextlib.contextmanager
def ray_session(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    object_store_memory: int = 1 << 30,
    temp_root: str = "/tmp",
) -> Iterator[bool]:
    """Ray for the length of a ``with`` block; yields whether this call started it.

    Args:
        address: join this running cluster (``"ray://host:10001"``, ``"host:6379"``
            or ``"auto"``); ``None`` starts a private local Ray.
        num_cpus: logical CPUs of the private Ray (default: the machine's).
        object_store_memory: bytes of the private object store (default 1 GiB,
            not Ray's 30 % of RAM).
        temp_root: where the private Ray's short ``sfr-XXXXXX`` folder goes.

    A Ray already initialised in this process is used as is and left running.
    A private Ray is shut down (and its folder removed) on leaving the block,
    also on an exception or Ctrl-C, so no worker process outlives the call.
    """
    ray = import_ray()
    if ray.is_initialized():
        yield False
        return
    tmp: str | None = None
    try:
        if address is not None:
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise RuntimeError(
                    f"cannot reach the Ray cluster at {address!r} ({' '.join(str(e).split())[:300]}): check the "
                    "address (`ray status` on the head node prints it), or leave --ray-address out to run on a "
                    "private local Ray"
                ) from None
        else:
            if len(temp_root) > _MAX_TEMP_ROOT:
                raise ValueError(
                    f"temp_root={temp_root!r} is {len(temp_root)} characters: Ray's socket paths under it would "
                    f"pass the 107-byte Unix limit; use a root of at most {_MAX_TEMP_ROOT} characters such as /tmp"
                )
            tmp = tempfile.mkdtemp(prefix="sfr-", dir=temp_root)
            ray.init(
                num_cpus=num_cpus,
                object_store_memory=int(object_store_memory),
                _temp_dir=tmp,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        yield True
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
