"""TileLang's expected in-memory cache hits (precompile, then the launcher's getter) are not logged; its other
messages are (kernels_cuda/_tilelang.py)."""

import logging

import pytest

from deepinfer_npu.kernels_cuda import _tilelang


@pytest.mark.tilelang
def test_memory_cache_hits_are_dropped_and_other_messages_kept(caplog):
    if _tilelang.tilelang is None:
        pytest.skip("tilelang is not installed")
    logger = logging.getLogger(_tilelang.CACHE_LOGGER)
    assert sum(isinstance(f, _tilelang.MemoryCacheHitFilter) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=_tilelang.CACHE_LOGGER):
        logger.warning("Found kernel '%s' in memory cache. For better performance, consider using `@tilelang.jit` "
                       "instead of direct kernel caching.", "rms_norm")
        logger.warning("Failed to load kernel %s from the disk cache", "rms_norm")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load kernel rms_norm from the disk cache"]
    _tilelang._install_filter()  # idempotent
    assert sum(isinstance(f, _tilelang.MemoryCacheHitFilter) for f in logger.filters) == 1
