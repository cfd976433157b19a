"""``run_parallel`` on CUDA: independent branches of a forward (the shared experts next to the routed ones, the
MLA prolog's latent projection next to the query's GEMMs) on a second stream forked from the current one and
joined back; inside graph capture this makes parallel branches of the graph.

In order at ``rows <= SERIAL_BRANCHES_MAX_ROWS``: a stream fork / join is a full dependency, which breaks the
programmatic launch chain of the TileLang kernels (measured on an H200: batch 1 399.2 tok/s in order against 375.6
on two streams, while batch 16 drops from 1922.0 to 1837.2 in order); in order without a device too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SERIAL_BRANCHES_MAX_ROWS = 1


class ParallelBranches:
    """The second stream of each device, made outside graph capture (``prepare``: at warm-up)."""

    def __init__(self) -> None:
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def parallel(rows: int | None) -> bool:
        """Whether ``run`` forks a second stream for ``rows`` token rows."""
        if not torch.cuda.is_available():
            return False
        return rows is None or rows > SERIAL_BRANCHES_MAX_ROWS

    def prepare(self) -> None:
        """Make the current device's second stream now, before any graph is captured."""
        if torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
            self._side_streams.setdefault(dev, torch.cuda.Stream(device=dev))

    def run(self, main: Callable[[], Any], side: tuple[Callable[[], Any], ...], rows: int | None) -> list[Any] | None:
        """``[main(), *side]`` with the side branches on the second stream; None where they run in order (the
        caller runs them)."""
        if not (side and self.parallel(rows)):
            return None
        cur = torch.cuda.current_stream()
        alt = self._side_streams.get(cur.device)
        if alt is None:
            if torch.cuda.is_current_stream_capturing():  # no stream creation inside a capture: in order this time
                return None
            alt = self._side_streams[cur.device] = torch.cuda.Stream(device=cur.device)
        alt.wait_stream(cur)
        side_out: list = []
        try:
            with torch.cuda.stream(alt):
                side_out = [f() for f in side]
            main_out = main()
        finally:  # joined even when a branch raises
            cur.wait_stream(alt)
            if not torch.cuda.is_current_stream_capturing():  # eager: side outputs are read on cur from now on
                for t in side_out:
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(cur)
        return [main_out, *side_out]
