"""A drafter's ``propose`` replayed from captured graphs, one per padded row count (same sizes rule as decode).

Only the main decode forward is graphed by ``worker/decode_graphs.py``; everything after it is launched eagerly
by Python, op by op. On a GPU that host work bounds a speculative step once the model is small or the batch is
(the DFlash propose is ~300 small ops per step). ``ProposeGraphs`` captures ``fn(**inputs)`` once per size ``S``
and replays it. The inputs are per-row tensors ``[S, *tail]``: by default ``golden, positions, slots`` (each
``[S]`` int64, DFlash); MTP's draft chain passes its anchor hidden states ``[S, D]``, positions and block tables
``[S, W]`` (a row's table narrower than ``W`` is padded with block 0, as ``pad_block_tables`` does):

* the step's ``B`` rows go into the first rows of static buffers; padding rows carry each input's pad value
  (zeros by default: token 0, position 0, state slot 0 = the reserved dummy slot that no sequence owns, block 0 =
  the padding block), and their outputs are dropped;
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


DEFAULT_INPUTS: dict[str, tuple] = {name: ((), torch.int64) for name in ("golden", "positions", "slots")}


class ProposeGraphs:
    def __init__(self, fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], runner: GraphRunner, max_rows: int,
                 device: torch.device, inputs: dict[str, tuple] | None = None) -> None:
        """``inputs``: name -> (per-row tail shape, dtype[, padding rows' value, default 0]) of ``fn``'s inputs, in
        ``run``'s order."""
        self.fn = fn
        self.graphs = runner
        self.sizes = graph_sizes(max(1, max_rows))
        self.disabled: str | None = None
        self.inputs = dict(inputs or DEFAULT_INPUTS)
        self.pad = {name: (spec[2] if len(spec) > 2 else 0) for name, spec in self.inputs.items()}
        s = self.sizes[-1]
        with torch.inference_mode():
            self.buf = {name: torch.full((s, *spec[0]), self.pad[name], dtype=spec[1], device=device)
                        for name, spec in self.inputs.items()}
        self.replays = 0

    def _graphed(self, **inputs: torch.Tensor):
        return self.fn(*(inputs[name] for name in self.inputs))  # positional, in ``inputs`` order

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size now (``graph_capture="startup"``) on all-padding rows (slot 0, position 0)."""
        for size in reversed(self.sizes):  # largest first
            if self.disabled or self.graphs.has(size):
                continue
            st = {name: t[:size] for name, t in self.buf.items()}
            for name, t in st.items():
                t.fill_(self.pad[name])
            try:
                self.graphs.capture(size, self._graphed, st)
            except Exception as e:  # noqa: BLE001 - propose stays correct, only eager
                self.disabled = f"capture of propose size {size} failed: {type(e).__name__}: {str(e)[:300]}"
                logger.warning("drafter graphs disabled: %s", self.disabled)

    @torch.inference_mode()
    def run(self, *tensors: torch.Tensor):
        """``tensors``: the step's rows of each input, in ``inputs`` order (a narrower trailing dim is zero-padded)
        -> ``(drafts [B, k], confidences [B, k])`` from the graph of the smallest size >= B, or None (run
        eagerly): graphs disabled, no rows, more rows than the largest size, or a row wider than the buffers."""
        b = tensors[0].shape[0]
        if self.disabled or b == 0 or b > self.sizes[-1]:
            return None
        if any(t.shape[1:] != self.buf[n].shape[1:] and (t.dim() != 2 or t.shape[1] > self.buf[n].shape[1])
               for n, t in zip(self.inputs, tensors)):
            return None
        size = next(s for s in self.sizes if s >= b)
        st = {name: t[:size] for name, t in self.buf.items()}
        for name, real in zip(self.inputs, tensors):
            buf = st[name]
            if real.dim() == 2 and real.shape[1] < buf.shape[1]:  # a narrower table: block 0 beyond it
                buf[:b, : real.shape[1]].copy_(real)
                buf[:b, real.shape[1] :].zero_()
            else:
                buf[:b].copy_(real)
            buf[b:].fill_(self.pad[name])
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
