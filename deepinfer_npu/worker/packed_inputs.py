"""A step's host arrays to device tensors through one pinned buffer and one copy.

The worker's forward takes five to seven small host arrays a step (query / context lengths, block tables, state
slots, the first input ids and their optimistic flags, draft caps). One ``pin_memory()`` and one non-blocking copy
each cost host time every step, which batch-1 decode feels (kernels_cuda/NOTES.md, session 8: the host was busy
0.92-2.08 ms of a 2.15-2.25 ms step). :func:`to_device` writes the arrays' bytes into one host buffer, each at a
256-byte-aligned offset (the alignment the device allocator gives a tensor of its own: vectorized kernel loads and
TMA stay legal), pins it once, copies it once, and returns typed views of the device buffer; no kernel runs.

Off by default (``DEEPINFER_PACK_STEP_INPUTS=1``: ``Worker``): on an H200 (session 10, V2-Lite shape) it gained
nothing beyond the run-to-run spread: 448.4 / 1954.1 / 6298.6 tok/s at batch 1 / 16 / 64 alone in one call against
443.7-444.1 / 1946.4-1948.4 / 6248.2-6257.1 without it in the next, and 407.0 at batch 1 when run second in that
call. The batch-1 step is device-bound (the host waits for the device in every window, 0.31-1.00 ms of a 2.17 ms
step), so host time saved does not shorten it; a host with less CPU headroom may differ. On the CPU the views
share the one host buffer, which the tests use to compare the two paths.
"""

from __future__ import annotations

import os

import numpy as np
import torch

ALIGN = 256
_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}


def enabled() -> bool:
    """``DEEPINFER_PACK_STEP_INPUTS``: "1" packs a step's inputs into one copy, "0" (the default) one copy each."""
    value = os.environ.get("DEEPINFER_PACK_STEP_INPUTS", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"DEEPINFER_PACK_STEP_INPUTS={value!r}: 0 or 1")
    return value == "1"


def to_device(arrays: list[tuple[np.ndarray, torch.dtype]], device: torch.device) -> list[torch.Tensor]:
    """``[(host array, dtype), ...]`` -> device tensors of those dtypes and the arrays' shapes, in order, from one
    buffer (a non-blocking copy through pinned memory on a device; no host-device sync)."""
    parts, offset = [], 0
    for a, dtype in arrays:
        if dtype not in _NUMPY:
            raise TypeError(f"to_device: dtype {dtype} (supported: {', '.join(map(str, _NUMPY))})")
        host = np.ascontiguousarray(a, dtype=_NUMPY[dtype])
        parts.append((host, dtype, offset))
        offset += -(-host.nbytes // ALIGN) * ALIGN
    raw = np.zeros(max(offset, 1), dtype=np.uint8)  # filled through numpy: no tensor read on the launch path
    for host, _, start in parts:
        raw[start : start + host.nbytes] = host.reshape(-1).view(np.uint8)
    buf = torch.from_numpy(raw)
    if device.type != "cpu":
        buf = buf.pin_memory().to(device, non_blocking=True)
    return [
        buf[start : start + host.nbytes].view(dtype).view(host.shape) for host, dtype, start in parts
    ]
