"""Captured-graph sizes, keyed by total_q (tokens in a decode step), shared by every backend and by varlen.

Seed §7.2 (``build_graph_batch_sizes``): 1, 2, 4, ... below the interval, then every ``interval`` tokens up to the
largest step (always included). The interval is ``DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`` (``deepinfer_npu.envs``,
default 8), so the sizes the step-time curve is profiled at are exactly the sizes graphs are captured for.
"""

from __future__ import annotations

from deepinfer_npu import envs


def graph_sizes(max_tokens: int, interval: int | None = None) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    interval = interval or envs.CUDAGRAPH_BATCH_SIZE_INTERVAL
    if interval < 1:
        raise ValueError(f"graph size interval must be a positive integer, got {interval}")
    sizes, s = [], 1
    while s < interval and s < max_tokens:
        sizes.append(s)
        s *= 2
    sizes += list(range(interval, max_tokens, interval))
    sizes.append(max_tokens)
    return sorted(set(sizes))
