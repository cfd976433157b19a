"""The MoE router's fp32 logits on the tensor cores: ``linear(hidden.float(), weight)`` for bf16 rows and an fp32
weight [E, D], as bf16 GEMMs with fp32 output, past the rows skinny_gemm takes. On by default;
``DEEPINFER_ROUTER_TENSOR_CORES=0`` keeps the composed form.

Why: the composed form casts the rows to fp32 (one launch) and runs cuBLAS' fp32 GEMM, which for E = 64 experts
is a few CUDA-core tiles over the whole of K. On an H200 at batch 256 (V2-Lite) the two took about 0.8 ms of kernel
spans a decode step. Through ``LLM.generate`` this form ran decode at batch 64 / 256 at 6434.7 / 21174.6 tok/s
(bf16) and 10014.6 / 21333.0 (FP8 weights), against 6359.5 / 20797.5 and 9114.7 / 20992.5 composed
(``docs/performance.md``).

Numerics: the weight is split once into bf16 parts whose sum is the weight, ``hi = bf16(w)``, ``mid = bf16(w -
hi)``, ``lo = bf16(w - hi - mid)``. Each part takes the next 8 bits of the 24-bit significand, so the sum is exact
for fp32 weights of magnitude between about 2**-110 and 3e38 (router weights are; beyond, the lower parts underflow
or ``hi`` overflows). A bf16 row times a bf16 part is exact in fp32; the tensor cores add the products in fp32, with
an internal rounding NVIDIA does not document (measurements describe block-wise alignment with truncation), so the
logits may differ from the fp32 GEMM's by a few 2**-23 of the sum of the products' magnitudes. A weight that is
bf16-valued (checkpoints ship the gate in bf16) has zero ``mid`` and ``lo``: one part, one GEMM, no reduction.
Otherwise the parts are stacked as [P x E, D] for one GEMM [T, P x E], and the P column blocks are summed (two
launches, as the cast and the fp32 GEMM were).

The split reads on the host whether the lower parts are zero, so it is made outside CUDA-graph capture, at a
weight's first eager call (the graph runner runs each size eagerly before capturing it). A call inside a capture
with no split yet, or a torch whose ``mm`` has no ``out_dtype`` (then for good), keeps the composed form; the op
report names the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_npu.hal.sync_guard import allow_sync

from .scaled_mm import _first_line

BF16 = torch.bfloat16
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", MemoryError)


def split_bf16(weight: torch.Tensor) -> list[torch.Tensor]:
    """``[hi, mid, lo]`` bf16 tensors whose fp32 sum is ``weight`` (fp32), dropping the trailing parts that are
    all zero (a bf16-valued weight gives ``[hi]``)."""
    parts, rest = [], weight.float()
    for _ in range(3):
        part = rest.to(BF16)
        parts.append(part)
        rest = rest - part.float()
    while len(parts) > 1 and not bool(parts[-1].any()):
        parts.pop()
    return parts


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


class RouterGemm:
    """The split weights by router weight, and the logits from them."""

    def __init__(self, mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _mm_fp32_out) -> None:
        self._mm = mm  # bf16 [T, D] x bf16 [D, N] -> fp32 [T, N]
        # id(weight) -> (the weight, its address, its stacked parts [P x E, D], P): the weight is kept so that its id
        # is not reused by another tensor while the split is cached; its address changes if its storage is replaced
        self._parts: dict[int, tuple[torch.Tensor, int, torch.Tensor, int]] = {}
        self.error: str | None = None  # set when the GEMM failed once: the composed form from then on

    def reason(self, hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
        """Why these operands keep the composed form (host facts), or None."""
        if self.error is not None:
            return self.error
        if hidden.dtype != BF16 or weight.dtype != torch.float32:
            return f"rows {hidden.dtype}, router {weight.dtype}: bf16 rows and an fp32 router only"
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            return f"rows {list(hidden.shape)}, router {list(weight.shape)}: not [T, D] x [E, D]"
        if self._cached(weight) is None and _capturing():
            return "the router's bf16 split is not made yet (CUDA-graph capture)"
        return None

    def _cached(self, weight: torch.Tensor):
        cached = self._parts.get(id(weight))
        ok = cached is not None and cached[0] is weight and cached[1] == weight.data_ptr()
        return cached if ok else None

    def parts(self, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(the stacked bf16 parts [P x E, D], P), made at the weight's first call."""
        cached = self._cached(weight)
        if cached is None:
            with allow_sync("the router's bf16 split reads on the host whether its lower parts are zero, once"):
                parts = split_bf16(weight)
            cached = self._parts[id(weight)] = (weight, weight.data_ptr(), torch.cat(parts).contiguous(),
                                                len(parts))
        return cached[2], cached[3]

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """fp32 [T, E] logits, or None where :meth:`reason` refuses or the GEMM failed (the caller composes)."""
        if self.reason(hidden, weight) is not None:
            return None
        stacked, count = self.parts(weight)
        try:
            out = self._mm(hidden, stacked.t())
        except OUT_OF_MEMORY:
            return None  # not a verdict on the form: this call composes, the next tries again
        except Exception as e:  # noqa: BLE001 - e.g. a torch whose mm has no out_dtype: the composed form for good
            self.error = f"bf16 GEMM with fp32 output failed: {_first_line(e)}"
            self._parts.clear()
            return None
        if count == 1:
            return out
        return out.view(out.shape[0], count, weight.shape[0]).sum(dim=1)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

