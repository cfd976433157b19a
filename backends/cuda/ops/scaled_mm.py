"""cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm``) for prefill-sized FP8 projections.

DeepGEMM's scales as cuBLASLt takes them: the activations' 1 x 128 group scales ``[M, K / 128]`` M-major, the
weights' 128 x 128 block scales ``[K / 128, N / 128]`` (some torch builds want K / 128 padded to a multiple of 4).
Measured on an H200 (``python -m deepinfer_npu.kernels_cuda.bench fp8_gemm``, 4096 rows, commit 313c886): 721-1106
TFLOP/s against ``kernels_cuda.fp8_gemm``'s tile form's 364-628 on the same shapes, cosine 0.99999 between the two.

Which form a torch build takes, and whether cuBLASLt takes a shape at all (CUDA >= 12.9, Hopper), is found on the
device, once per ``(N, K, M % 4)`` (public cuBLASLt users pad the activations' scale rows to a multiple of 4; what
an unaligned M does is found, not assumed): the first eager call of a key runs both GEMMs on random activations of
``CHECK_ROWS`` sizes with that remainder (distinct rows and per-group scales, so a scale read from the wrong row or
group shows) and the layer's own weight, and keeps cuBLASLt only where every element agrees with the tile kernel
(``disagreement``); the forms tried, in order: the scales as they are, then K / 128 padded to a multiple of 4, then
(unaligned M) the rows padded to a multiple of 4, then every operand zero-padded to aligned N (128), K (512) and rows
(4) (on an H200 with torch 2.11, one engine key at M % 4 = 3 was refused in every other form). A key it refuses or
gets wrong stays on the tile kernel, with the reason in the op report; so does a key whose accepted form later
raises (another M picks another cuBLASLt kernel).
The check reads its result on the host, so it never runs inside CUDA-graph capture: a captured step takes
cuBLASLt where the eager run before the capture checked its key, else the tile kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_npu.hal.sync_guard import allow_sync

CHECK_ROWS = (68, 1024)  # plus M % 4: just past the swapped GEMM's 64 rows, and a size tiled in M
RTOL, ATOL_OF_MAX = 2e-2, 2e-3  # element-wise: two fp32-accumulated GEMMs rounded to bf16, in other orders
OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", MemoryError)


@dataclass(frozen=True)
class Form:
    """How cuBLASLt takes one key's operands: ``scales`` "plain" (the weight's scales as they are) or "padded"
    (K / 128 padded to a multiple of 4); ``pad_rows``: the activations padded to a multiple of 4 rows;
    ``pad_nk``: the weight zero-padded to N a multiple of 128 and K of 512 (its block scales with ones), the
    activations' K likewise, rows to a multiple of 4, and the output's columns sliced back: every operand aligned,
    for shapes such as kv_a's N = 576 or a down projection's K / 128 = 11. Zeros add nothing to the product."""

    scales: str
    pad_rows: bool = False
    pad_nk: bool = False


FORMS = (Form("plain"), Form("padded"), Form("plain", pad_rows=True), Form("padded", pad_rows=True),
         Form("plain", pad_nk=True))
N_ALIGN, K_ALIGN = 128, 512  # pad_nk: one weight block of N; four scale groups of K


class ScaledMM:
    def __init__(self) -> None:
        self.forms: dict[tuple[int, int, int], Form | None] = {}  # (N, K, M % 4) -> the form, or None: refused
        self.errors: dict[tuple[int, int, int], str] = {}
        # (address, shape) -> (the weight's scales, their padded copy); the scales are kept so that their address
        # is not reused by another tensor while the copy is cached
        self._padded: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        # id(weight) -> (the weight, its zero-padded copy, its padded scales): Form.pad_nk
        self._padded_nk: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def available(self) -> str | None:
        """Why cuBLASLt's block-scaled GEMM cannot run at all here, or None."""
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
        return None

    def gemm(self, aq: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
             tile) -> tuple[torch.Tensor | None, str | None]:
        """``aq`` [M, K] e4m3 with ``sa`` [M, K / 128] times ``w`` [N, K] e4m3 with ``sw`` [N / 128, K / 128] ->
        (the bf16 [M, N] product, None), or (None, why) where the caller runs the tile kernel instead. ``tile(a, s)``:
        the tile kernel's GEMM of activations ``a`` with scales ``s`` by this weight (the check compares against
        it)."""
        m = int(aq.shape[0])
        key = (int(w.shape[0]), int(w.shape[1]), m % 4)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if key not in self.forms:
            if capturing:
                return None, "not checked yet (CUDA-graph capture)"
            try:
                self._check(key, sa, w, sw, tile)
            except OUT_OF_MEMORY:  # not a verdict on cuBLASLt: the key is checked again at a later call
                return None, "not checked yet (out of device memory for the check)"
        form = self.forms[key]
        if form is None:
            return None, self.errors[key]
        operands = self._weight(w, sw, form, capturing)
        if operands is None:
            return None, "this weight's padded scales are not made yet (CUDA-graph capture)"
        try:
            return self._run(aq, sa, *operands, form), None
        except Exception as e:  # noqa: BLE001 - an M the check did not try: this key goes back to the tile kernel
            self.forms[key] = None
            self.errors[key] = (f"torch._scaled_mm failed at M={m}, N={key[0]}, K={key[1]} after its check passed "
                                f"({_first_line(e)})")
            return None, self.errors[key]

    def _weight(self, w, sw, form: Form, capturing: bool = False) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(the weight as ``form`` passes it, its scales as cuBLASLt takes them, the output's N), or None where a
        padded copy would first be made inside a capture."""
        if form.pad_nk:
            padded = self._padded_weight(w, sw, capturing)
            return None if padded is None else (padded[0], padded[1].t(), int(w.shape[0]))
        scale_b = self._scale_b(sw, form.scales, capturing)
        return None if scale_b is None else (w, scale_b, int(w.shape[0]))

    def _padded_weight(self, w, sw, capturing: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        cached = self._padded_nk.get(id(w))
        if cached is None or cached[0] is not w:
            if capturing:
                return None
            (n, k), (nb, kb) = w.shape, sw.shape
            np_, kp = -(-n // N_ALIGN) * N_ALIGN, -(-k // K_ALIGN) * K_ALIGN
            wp = torch.zeros(np_, kp, dtype=w.dtype, device=w.device)
            wp[:n, :k] = w
            swp = torch.ones(np_ // 128, kp // 128, dtype=sw.dtype, device=sw.device)
            swp[:nb, :kb] = sw
            cached = self._padded_nk[id(w)] = (w, wp, swp)
        return cached[1], cached[2]

    def _run(self, aq, sa, w, scale_b, n: int, form: Form) -> torch.Tensor:
        m, k = aq.shape
        if form.pad_nk and w.shape[1] != k:  # the activations' K as the padded weight's
            a2 = torch.zeros(m, w.shape[1], dtype=aq.dtype, device=aq.device)
            a2[:, :k] = aq
            s2 = torch.ones(m, w.shape[1] // 128, dtype=sa.dtype, device=sa.device)
            s2[:, : sa.shape[1]] = sa
            aq, sa = a2, s2
        if (form.pad_rows or form.pad_nk) and m % 4:
            extra = 4 - m % 4
            aq = torch.cat([aq, aq.new_zeros(extra, aq.shape[1])])
            sa = torch.cat([sa, sa.new_ones(extra, sa.shape[1])])
        scale_a = sa.t().contiguous().t()  # M-major, as cuBLASLt reads the activations' group scales
        out = torch._scaled_mm(aq, w.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        out = out[:m] if out.shape[0] != m else out
        return out[:, :n].contiguous() if out.shape[1] != n else out

    def _scale_b(self, sw: torch.Tensor, layout: str, capturing: bool = False) -> torch.Tensor | None:
        """The weight's scales as cuBLASLt takes them; None where the padded copy would first be made inside a
        capture (recorded, not run: an eager call before the replay would read an unfilled buffer)."""
        if layout == "plain":
            return sw.t()
        key = (sw.data_ptr(), tuple(sw.shape))  # a weight's scales do not change after load
        cached = self._padded.get(key)
        if cached is None or cached[0] is not sw:
            if capturing:
                return None
            kb = sw.shape[1]
            padded = torch.zeros(sw.shape[0], -(-kb // 4) * 4, device=sw.device, dtype=sw.dtype)
            padded[:, :kb] = sw
            cached = self._padded[key] = (sw, padded[:, :kb])
        return cached[1].t()

    def _check(self, key, sa, w, sw, tile) -> None:
        """Find the first form that agrees with the tile kernel on random activations of every ``CHECK_ROWS`` size
        (with this key's M % 4), or record why none does."""
        cases = [_random_activations(rows + key[2], int(w.shape[1]), int(sa.shape[1]), w.device, seed)
                 for seed, rows in enumerate(CHECK_ROWS)]
        wants = [tile(a, s) for a, s in cases]
        errors = []
        with allow_sync("the cuBLASLt check reads its comparison on the host, once per key"):
            for form in FORMS:
                if form.pad_rows and key[2] == 0:
                    continue  # nothing to pad
                why = None
                for (a, s), want in zip(cases, wants):
                    try:
                        why = disagreement(self._run(a, s, *self._weight(w, sw, form), form), want)
                    except OUT_OF_MEMORY:
                        raise
                    except Exception as e:  # noqa: BLE001 - a refused form: try the next, then the tile kernel
                        why = _first_line(e)
                    if why is not None:
                        why = f"M={a.shape[0]}: {why}"
                        break
                if why is None:
                    self.forms[key] = form
                    return
                errors.append(f"{_describe(form)}: {why}")
        self.forms[key] = None
        self.errors[key] = (f"torch._scaled_mm refused or disagreed at N={key[0]}, K={key[1]}, M % 4 = {key[2]} "
                            f"({'; '.join(errors)})")


def _random_activations(rows: int, k: int, groups: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 activations [rows, k] and group scales [rows, groups]: every row and group its own power of two (exact
    in both GEMMs), so a scale taken from another row or group changes the product."""
    g = torch.Generator(device=device).manual_seed(1234 + seed)
    a = torch.randn(rows, k, generator=g, device=device).to(torch.float8_e4m3fn)
    s = torch.exp2(torch.randint(-4, 5, (rows, groups), generator=g, device=device).float())
    return a, s


def _describe(form: Form) -> str:
    if form.pad_nk:
        return f"N, K and rows padded to {N_ALIGN}, {K_ALIGN} and 4"
    return f"{form.scales} scales{', rows padded' if form.pad_rows else ''}"


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def disagreement(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why ``got`` is not ``want`` up to the rounding of two FP8 GEMMs, element by element (``RTOL`` of the element
    plus ``ATOL_OF_MAX`` of the largest), or None."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"result {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    g, w = got.float(), want.float()
    if not bool(torch.isfinite(g).all()):
        return "non-finite values"
    err = (g - w).abs()
    bound = RTOL * w.abs() + ATOL_OF_MAX * float(w.abs().max()) if w.numel() else err
    bad = err > bound
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        return (f"{int(bad.sum())} of {bad.numel()} elements off the tile kernel's, first at [{row}, {col}]: "
                f"{g[row, col].item():.5g} against {w[row, col].item():.5g}")
    return None
