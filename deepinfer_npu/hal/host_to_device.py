"""Host arrays to device tensors in one copy, without making the host wait.

A step's launch path sends a handful of small host arrays (lengths, block tables, state slots, sampling parameters).
Copied one by one, each costs a pinned allocation, a dtype conversion and a copy launch (tens of microseconds of host
time each, which at batch 1 is a visible part of a step). :func:`to_device` packs them into one staging buffer (pinned
on devices: a pageable copy would block), copies that once, and returns views of the copy, one per array, each at an
aligned offset with the requested dtype and the array's shape. The caching host allocator keeps a pinned buffer from
reuse until its copy has run, so the caller may build the next step's buffer at once.

On the CPU the staging buffer is the result: the tensors are copies of the arrays (never views of the caller's
memory), exactly as on a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: torch dtypes the staging buffer holds, with the numpy dtype that writes them
NUMPY_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
                torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.float64: np.float64}

_ALIGN = 16  # bytes: every view starts at a multiple of any element size above


def to_device(arrays: Sequence[tuple[np.ndarray | Sequence, torch.dtype]],
              device: torch.device | str) -> list[torch.Tensor]:
    """``[(array, dtype), ...]`` -> one tensor per array on ``device``, converted to ``dtype`` (numpy's casting of
    an assignment, as ``torch.from_numpy(a).to(dtype)``), with the array's shape; one host-to-device copy."""
    device = torch.device(device)
    host = [np.asarray(a) for a, _ in arrays]
    layout, nbytes = [], 0  # (byte offset, dtype, shape) an array
    for a, (_, dtype) in zip(host, arrays):
        if dtype not in NUMPY_DTYPES:
            raise TypeError(f"to_device: no staging for {dtype} (supported: {sorted(map(str, NUMPY_DTYPES))})")
        layout.append((nbytes, dtype, a.shape))
        nbytes += -(-a.size * NUMPY_DTYPES[dtype]().itemsize // _ALIGN) * _ALIGN
    stage = torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8, pin_memory=device.type != "cpu")
    views = _views(stage, layout)
    for v, a in zip(views, host):
        if a.size:
            v.copy_(torch.from_numpy(a if a.flags.c_contiguous else a.copy()))  # host to host, to the dtype
    if device.type == "cpu":
        return views
    return _views(stage.to(device, non_blocking=True), layout)


def _views(buf: torch.Tensor, layout: list[tuple[int, torch.dtype, tuple]]) -> list[torch.Tensor]:
    """The arrays' places in the byte buffer ``buf``: one reinterpretation per dtype, one strided view an array
    (a view costs the host about a microsecond; the step sends several arrays)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for off, dtype, shape in layout:
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = buf.view(dtype)  # the buffer's length is a multiple of every element size
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        out.append(base.as_strided(shape, strides, off // base.element_size()))
    return out
