"""Suite-wide settings: tests run tiny models, for which one intra-op thread beats a thread pool (and is immune to
oversubscribed CI hosts, where spinning OpenMP workers made model tests ~100x slower)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
