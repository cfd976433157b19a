"""A process-wide "no implicit host-device sync" flag for the launch path.

``Backend.forbid_sync()`` enters :func:`forbid_sync`; code that would block on the device (``.item()``,
``.tolist()`` on device tensors, ``synchronize()``) calls :func:`check_sync_allowed` first. Device backends
additionally switch their runtime's own sync debug mode to "error" so syncs hidden inside torch are caught
too; on the CPU backend the flag is all there is, which still lets the engine's tests prove the launch path
never asks for a sync.

``DEEPINFER_DISABLE_SYNC_GUARD=1`` turns the guard off for debugging.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from deepinfer_npu import envs

_state = threading.local()


class SyncForbiddenError(RuntimeError):
    """Raised when a host-device synchronisation is requested inside ``forbid_sync()``."""


def guard_enabled() -> bool:
    """False when ``DEEPINFER_DISABLE_SYNC_GUARD=1`` (checked on every call so tests can toggle it)."""
    return not envs.DISABLE_SYNC_GUARD


def sync_forbidden() -> bool:
    """True while the current thread is inside ``forbid_sync()`` (and the guard is enabled)."""
    return guard_enabled() and getattr(_state, "depth", 0) > 0


def check_sync_allowed(what: str) -> None:
    """Raise :class:`SyncForbiddenError` naming ``what`` if syncs are forbidden on this thread."""
    if sync_forbidden():
        raise SyncForbiddenError(
            f"{what} synchronises host and device inside forbid_sync() (the launch path must not wait); "
            "set DEEPINFER_DISABLE_SYNC_GUARD=1 to debug"
        )


@contextlib.contextmanager
def forbid_sync() -> Iterator[None]:
    """Mark the current thread's code as launch path: :func:`check_sync_allowed` raises inside. Re-entrant."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


@contextlib.contextmanager
def allow_sync(reason: str) -> Iterator[None]:
    """A known, documented sync inside the launch path (``reason`` says which): the guard and torch's CUDA
    sync-debug mode stand down for the block, e.g. the expert-parallel all-to-all, whose split sizes the host
    must know."""
    import torch

    depth, _state.depth = getattr(_state, "depth", 0), 0
    cuda_mode = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _state.depth = depth
        if cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(cuda_mode)


# ---------------------------------------------------------------------------------------------------------------
# Host-read detection for the CPU backend (tests). On a device, reading a tensor's values on the host waits for
# the device; on the CPU nothing waits, so the launch path could silently grow such reads. ``HostReadDetector``
# records every value read (``item``, ``tolist``, ``bool(t)``, data-dependent shapes such as ``nonzero`` or
# boolean indexing) made inside ``forbid_sync()`` by engine code. Kernel ops (files under ``backends/``) are the
# backend's own business and are exempt: device backends implement them natively without syncs.

_READ_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "masked_select", "unique", "unique_consecutive"}


def _engine_frame() -> str | None:
    """The innermost calling frame outside torch and this module, unless a backend kernel is on the stack."""
    import sys

    frame = sys._getframe(2)
    where = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/backends/" in name:
            return None
        if where is None and "/torch/" not in name and not name.endswith("sync_guard.py"):
            where = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return where


def _is_sync_call(func, args, kwargs) -> bool:
    import torch

    name = getattr(func, "__name__", "")
    if name in _READ_METHODS:
        return True
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
        return len(args) >= 2 and isinstance(args[1], torch.Tensor) and args[1].numel() > 1
    if name == "__getitem__" and len(args) >= 2:
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
    return False


class HostReadDetector:
    """Context manager: counts host reads of tensor values made by engine code inside ``forbid_sync()``.

    ``reads`` lists ``(function, location)``; use as ``with HostReadDetector() as d: ...; assert not d.reads``.
    """

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self._mode = None

    def __enter__(self) -> HostReadDetector:
        from torch.overrides import TorchFunctionMode

        detector = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if sync_forbidden() and _is_sync_call(func, args, kwargs):
                    where = _engine_frame()
                    if where is not None:
                        detector.reads.append((getattr(func, "__name__", str(func)), where))
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
