"""Contract-emulation and golden tests run tiny models: one intra-op thread is fastest and immune to
oversubscription."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
