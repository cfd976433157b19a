"""parity_tests/ is a plain folder (not a package): make its helpers (npu_emulation/) importable."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

torch.set_num_threads(1)  # tiny models: one intra-op thread is fastest and immune to oversubscription
