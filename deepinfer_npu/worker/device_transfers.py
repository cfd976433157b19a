"""Host <-> device copies that never make the host wait: the worker's launch path runs under
``backend.forbid_sync()``, and its results must reach the host without waiting for steps launched after them.

A mixin of ``Worker``: it reads ``self.device``.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer_npu.hal.host_to_device import to_device


class DeviceTransfers:
    """``_dev`` / ``_dev_many``: host arrays to the device; ``_to_host``: device results to pinned host memory."""

    def _dev(self, a: np.ndarray, dtype=torch.int64) -> torch.Tensor:
        """Host array -> device tensor without a host-device sync: on devices the copy goes through pinned
        memory asynchronously (a pageable copy would block)."""
        return to_device([(a, dtype)], self.device)[0]

    def _dev_many(self, arrays: list[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        """Several host arrays -> device tensors in one copy (``hal/host_to_device.py``)."""
        return to_device(arrays, self.device)

    def _to_host(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Device tensor -> host tensor filled asynchronously (pinned, ``non_blocking``): the copy is queued on the
        stream behind the step's work, so post-processing waits for this step's end event only, never for work
        launched after it (a plain ``.cpu()`` would wait for the next step's forward too, undoing ZOS)."""
        if t is None:
            return t
        if t.device.type == "cpu":  # a copy: the tensor may be a graph's static output, rewritten by the next step
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

