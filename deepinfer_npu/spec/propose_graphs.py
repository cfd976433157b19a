"""A drafter's ``propose`` replayed from captured graphs, one per padded row count (same sizes rule as decode).

Only the main decode forward is graphed by ``worker/decode_graphs.py``; everything after it is launched eagerly
by Python, op by op. On a GPU that host work bounds a speculative step once the model is small or the batch is
(the DFlash propose is ~300 small ops per step). ``ProposeGraphs`` captures ``fn(golden, positions, slots)``
(each ``[S]`` int64, ``S`` a graph size) once per size and replays it:

* the step's ``B`` rows go into the first rows of static buffers; padding rows carry token 0, position 0 and
  state slot 0 (the reserved dummy slot that no sequence owns), and their outputs are dropped;
* ``fn`` must be row-independent and sync-free, and read per-slot state only through persistent tensors (the
  drafter's ring buffer), so a replay sees the current state;
* outputs are views into the graph's static outputs, valid until the next replay of that size: the worker copies
  drafts and confidences out (slot state, the host copy) before the next step's propose.

A failed capture (an op that syncs, say) turns these graphs off with the reason; ``propose`` then runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from deepinfer_npu.hal.graph_runner import GraphRunner
from deepinfer_npu.hal.graph_sizes import graph_sizes

logger = logging.getLogger(__name__)


class ProposeGraphs:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], runner: GraphRunner, max_rows: int,
                 device: torch.device) -> None:
        self.fn = fn
        self.graphs = runner
        self.sizes = graph_sizes(max(1, max_rows))
        self.disabled: str | None = None
        s = self.sizes[-1]
        with torch.inference_mode():
            self.buf = {name: torch.zeros(s, dtype=torch.int64, device=device)
                        for name in ("golden", "positions", "slots")}
        self.replays = 0

    def _graphed(self, golden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        return self.fn(golden, positions, slots)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size now (``graph_capture="startup"``) on all-padding rows (slot 0, position 0)."""
        for size in reversed(self.sizes):  # largest first
            if self.disabled or self.graphs.has(size):
                continue
            st = {name: t[:size] for name, t in self.buf.items()}
            for t in st.values():
                t.zero_()
            try:
                self.graphs.capture(size, self._graphed, st)
            except Exception as e:  # noqa: BLE001 - propose stays correct, only eager
                self.disabled = f"capture of propose size {size} failed: {type(e).__name__}: {str(e)[:300]}"
                logger.warning("drafter graphs disabled: %s", self.disabled)

    @torch.inference_mode()
    def run(self, golden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        """-> ``(drafts [B, k], confidences [B, k])`` from the graph of the smallest size >= B, or None (run
        eagerly): graphs disabled, no rows, or more rows than the largest size."""
        b = golden.shape[0]
        if self.disabled or b == 0 or b > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= b)
        st = {name: t[:size] for name, t in self.buf.items()}
        for name, real in (("golden", golden), ("positions", positions), ("slots", slots)):
            st[name][:b].copy_(real)
            st[name][b:].zero_()
        if not self.graphs.has(size):
            try:
                self.graphs.capture(size, self._graphed, st)
            except Exception as e:  # noqa: BLE001 - propose stays correct, only eager
                self.disabled = f"capture of propose size {size} failed: {type(e).__name__}: {str(e)[:300]}"
                logger.warning("drafter graphs disabled: %s", self.disabled)
                return None
        drafts, confs = self.graphs.replay(size)
        self.replays += 1
        return drafts[:b], confs[:b]
