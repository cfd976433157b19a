"""Suite-wide settings and fixtures.

Tests run tiny models, for which one intra-op thread beats a thread pool (and is immune to oversubscribed CI hosts,
where spinning OpenMP workers made model tests ~100x slower); each test starts on one thread even when an engine
built by an earlier test set another count.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.hal.graph_runner import EagerReplayRunner
from deepinfer_npu.hal.registry import get_backend
from tests.xdist_groups import pytest_collection_modifyitems  # noqa: F401 (a hook)

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--all-kernel-configs", action="store_true", default=False,
                     help="tests/kernels_cuda/test_compile.py: compile every CI_CONFIGS entry for sm_90a, not only "
                     "the first of each kernel kind")


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def graph_runners(monkeypatch):
    """Give the CPU backend an ``EagerReplayRunner`` (captured graphs replayed eagerly); -> the runners handed out."""
    made: list[EagerReplayRunner] = []

    def factory(self):
        made.append(EagerReplayRunner())
        return made[-1]

    monkeypatch.setattr(type(get_backend("cpu")), "graph_runner", factory)
    return made
