"""cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm``) for prefill-sized FP8 projections.

DeepGEMM's scales as cuBLASLt takes them: the activations' 1 x 128 group scales ``[M, K / 128]`` M-major, the
weights' 128 x 128 block scales ``[K / 128, N / 128]`` (some torch builds want K / 128 padded to a multiple of 4).
Measured on an H200 (``python -m deepinfer_npu.kernels_cuda.bench fp8_gemm``, 4096 rows, commit 313c886): 721-1106
TFLOP/s against ``kernels_cuda.fp8_gemm``'s tile form's 364-628 on the same shapes, cosine 0.99999 between the two.

Which layout a torch build takes, and whether cuBLASLt takes a shape at all (CUDA >= 12.9, Hopper), is found on the
device: the first eager call of each ``(N, K)`` runs both GEMMs on its operands once and keeps cuBLASLt only where
its result agrees with the tile kernel's (cosine >= ``MIN_COSINE``, relative error <= ``MAX_REL_ERROR``: a wrong
layout or scale misses both by orders of magnitude); a shape it refuses or gets wrong stays on the tile kernel,
with the reason in the op report. The check reads its result on the host once per shape (outside CUDA-graph
capture; captured steps keep the tile kernel).
"""

from __future__ import annotations

import torch

MIN_COSINE = 0.9999
MAX_REL_ERROR = 1e-2


class ScaledMM:
    def __init__(self) -> None:
        self.layouts: dict[tuple[int, int], str | None] = {}  # (N, K) -> "plain" / "padded", or None: refused
        self.errors: dict[tuple[int, int], str] = {}
        self._padded: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def available(self) -> str | None:
        """Why cuBLASLt's block-scaled GEMM cannot run at all here, or None."""
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        return None

    def gemm(self, aq: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
             tile) -> tuple[torch.Tensor | None, str | None]:
        """``aq`` [M, K] e4m3 with ``sa`` [M, K / 128] times ``w`` [N, K] e4m3 with ``sw`` [N / 128, K / 128] ->
        (the bf16 [M, N] product, None), or (None, why) where the caller runs ``tile()`` instead. ``tile``: the tile
        kernel's GEMM on the same operands (the first call of a shape compares against it)."""
        key = (int(w.shape[0]), int(w.shape[1]))
        if key in self.layouts:
            layout = self.layouts[key]
            return (self._run(aq, sa, w, sw, layout), None) if layout is not None else (None, self.errors[key])
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None, "not checked yet (CUDA-graph capture)"
        return self._check(key, aq, sa, w, sw, tile)

    def _run(self, aq, sa, w, sw, layout: str) -> torch.Tensor:
        scale_a = sa.t().contiguous().t()  # M-major, as cuBLASLt reads the activations' group scales
        return torch._scaled_mm(aq, w.t(), scale_a=scale_a, scale_b=self._scale_b(sw, layout),
                                out_dtype=torch.bfloat16)

    def _scale_b(self, sw: torch.Tensor, layout: str) -> torch.Tensor:
        if layout == "plain":
            return sw.t()
        key = (sw.data_ptr(), tuple(sw.shape))  # a weight's scales do not change after load
        padded = self._padded.get(key)
        if padded is None:
            kb = sw.shape[1]
            padded = torch.zeros(sw.shape[0], -(-kb // 4) * 4, device=sw.device, dtype=sw.dtype)
            padded[:, :kb] = sw
            padded = self._padded[key] = padded[:, :kb]
        return padded.t()

    def _check(self, key, aq, sa, w, sw, tile) -> tuple[torch.Tensor | None, str | None]:
        want = tile()
        errors = []
        sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
        if sync_mode:
            torch.cuda.set_sync_debug_mode(0)  # this once per shape: the comparison is read on the host
        try:
            for layout in ("plain", "padded"):
                try:
                    got = self._run(aq, sa, w, sw, layout)
                    why = disagreement(got, want)
                except Exception as e:  # noqa: BLE001 - a refused layout or shape: try the next, then the tile kernel
                    why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
                if why is None:
                    self.layouts[key] = layout
                    return got, None
                errors.append(f"{layout} scales: {why}")
        finally:
            if sync_mode:
                torch.cuda.set_sync_debug_mode(sync_mode)
        self.layouts[key] = None
        self.errors[key] = f"torch._scaled_mm refused or disagreed at N={key[0]}, K={key[1]} ({'; '.join(errors)})"
        return None, self.errors[key]


def disagreement(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why ``got`` is not ``want`` up to the rounding of two FP8 GEMMs (cosine, relative Frobenius error), or
    None."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"result {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    g, w = got.float().flatten(), want.float().flatten()
    if not bool(torch.isfinite(g).all()):
        return "non-finite values"
    norm = float(w.norm())
    rel = float((g - w).norm()) / max(norm, 1e-30)
    cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0)) if norm > 0 else (1.0 if rel == 0 else 0.0)
    if cos < MIN_COSINE or rel > MAX_REL_ERROR:
        return f"cosine {cos:.6f}, relative error {rel:.2e} against the tile kernel"
    return None
