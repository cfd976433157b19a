"""Model tests use tiny tensors: one intra-op thread is faster than a thread pool (and immune to
oversubscribed CI hosts, where spinning OpenMP workers made these tests ~100x slower)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
