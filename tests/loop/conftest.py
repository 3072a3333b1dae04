from __future__ import annotations

import json
import os
import time

import pytest
import torch.multiprocessing as mp

from sftpack.testing import tiny_chat_tokenizer
from tests.helpers import tiny_samples


@pytest.fixture(scope="session")
def samples():
    return tiny_samples()


@pytest.fixture(autouse=True)
def cache_in_tmp(tmp_path_factory, monkeypatch):
    """``sftpack train`` caches tokenized data: never in the user's ~/.cache from a test."""
    monkeypatch.setenv("SFTPACK_CACHE_DIR", str(tmp_path_factory.mktemp("sftpack-cache")))


@pytest.fixture(scope="session")
def chat(tmp_path_factory):
    """40 short chats in a JSONL file and a local ChatML tokenizer (``root/tok``)."""
    root = tmp_path_factory.mktemp("chat")
    tiny_chat_tokenizer("chatml").save_pretrained(root / "tok")
    with (root / "chat.jsonl").open("w") as f:
        for i in range(1, 41):
            msgs = [
                {"role": "user", "content": "count " * (i % 7 + 1)},
                {"role": "assistant", "content": "one two three " * (i % 5 + 1)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return root


def run_ranks(worker, args: tuple, nprocs: int = 2) -> None:
    """``worker(rank, *args)`` in ``nprocs`` forked processes (the ranks of a gloo run), waited for.

    A collective that waits forever must fail the test, not hang it. Not a timing assertion:
    the run takes seconds; 600 s only bounds a hang, even on a loaded machine.
    """
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    os.kill(p.pid, 9)
            pytest.fail(f"the {nprocs}-rank run did not finish in 600 s")
