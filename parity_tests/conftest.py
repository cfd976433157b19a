"""Contract-emulation and golden tests run tiny models: one intra-op thread is fastest and immune to
oversubscription."""

from __future__ import annotations

import torch

from tests.xdist_groups import pytest_collection_modifyitems  # noqa: F401 (a hook)

torch.set_num_threads(1)
