from __future__ import annotations

import pytest
import torch

from ._tiny import tiny_samples


@pytest.fixture(scope="session")
def samples():
    return tiny_samples()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one thread is about 10x faster than
    two threads contending with other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
