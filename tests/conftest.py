"""Fixtures of the whole suite."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread in every test: the suite's models are tiny (one thread is faster and steadier
    than several contending with the other test worker and other processes), and a test process
    that forks ranks or workers hands them one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
