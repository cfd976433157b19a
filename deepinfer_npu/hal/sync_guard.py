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
import os
import threading
from collections.abc import Iterator

_state = threading.local()


class SyncForbiddenError(RuntimeError):
    """Raised when a host-device synchronisation is requested inside ``forbid_sync()``."""


def guard_enabled() -> bool:
    """False when ``DEEPINFER_DISABLE_SYNC_GUARD=1`` (checked on every call so tests can toggle it)."""
    return os.environ.get("DEEPINFER_DISABLE_SYNC_GUARD", "0") != "1"


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
