"""``tilelang`` and its language module ``T`` when tilelang is importable, else None: importing a kernel module (its
host-side checks and configuration functions) needs no tilelang; building or launching a kernel does.

TileLang warns each time ``tilelang.compile`` is served from its in-memory cache. The warm-up compiles a
configuration, then asks the launcher's cached getter for it once so the launches find it (every kernel module's
``precompile``): an expected cache hit per configuration, about a hundred warnings at a V2-Lite engine's start. A
filter on TileLang's cache logger drops exactly that message; every other TileLang message is kept.

Importing this module with tilelang also installs the CUDA post-processing hook of ``_producer_wait`` (only the
elected producer thread waits for a free pipeline stage), so every kernel the engine compiles gets it.
"""

import logging

try:
    import tilelang
    import tilelang.language as T
except Exception:  # pragma: no cover - exercised where tilelang is absent
    tilelang = None
    T = None

CACHE_LOGGER = "tilelang.cache.kernel_cache"


class MemoryCacheHitFilter(logging.Filter):
    """Drops TileLang's "Found kernel '...' in memory cache" warning (an expected hit, see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not (msg.startswith("Found kernel") and "in memory cache" in msg)


def _install_filter() -> None:
    logger = logging.getLogger(CACHE_LOGGER)
    if not any(isinstance(f, MemoryCacheHitFilter) for f in logger.filters):
        logger.addFilter(MemoryCacheHitFilter())


if tilelang is not None:
    _install_filter()
    from ._producer_wait import install as _install_producer_wait

    _install_producer_wait()

__all__ = ["T", "tilelang"]
