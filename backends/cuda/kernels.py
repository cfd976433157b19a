"""CudaKernelSet: each HAL op on a TileLang kernel (``kernels_cuda/``) where dtype and shapes fit, on a sync-free
torch rewrite of the reference where that was cheap, else on the CPU reference op running on CUDA tensors.

Decisions are taken per call from host facts only (dtypes, shapes, the host bound on the query length), never
from device values, and every path taken is remembered for :meth:`op_report`. Kernels are imported and compiled
at start-up by :meth:`warmup` (every configuration the engine can reach: ``backends/cuda/warmup.py``), else lazily
on the first call that selects them (TileLang caches them per configuration, in memory and on disk).

What is native today (bf16, DeepSeek dims; each kernel file holds its reference, check and benchmark):

- ``mla_attention``: ``kernels_cuda.mla_decode`` (paged absorbed MLA, FlashMLA layout) for steps whose host max
  query length is 1..16 with bf16 and the real DeepSeek dims (kv_lora 512 + rope 64, page 64): decode and
  draft verification (64-row tiles on a Hopper: ``kernels_cuda.mla_decode_ws``, warp-specialized). Prefill
  chunks (host max query length > 16, same dtype and dims): ``kernels_cuda.mla_decode.mla_prefill`` (causal tile
  bound). Other decode shapes: a dense sync-free composition; other prefill chunks (exact host lengths) the
  reference arithmetic looping on those host ints (sync-free); anything else the reference (a sync, reported).
- ``rms_norm`` / ``add_rms_norm``: ``kernels_cuda.rms_norm`` for bf16 rows of width 512..7168 (multiple of 256).
- ``mla_prolog``: the projections through ``linear`` (for one row the query's first projection and kv_a as one
  ``skinny_gemm`` launch, ``MLAWeights.fused_a_proj``; ``DEEPINFER_CUDA_FUSED_A_PROJ=0``: two), W_UK of one token on
  ``kernels_cuda.mla_absorb``, else cuBLAS' batched GEMM, then
  ``kernels_cuda.mla_rope_cache`` (q RoPE, c_kv RMSNorm, k RoPE and the latent-cache write in one launch); else the
  reference arithmetic with a sync-free cache write.
- ``silu_and_mul``: ``kernels_cuda.silu_mul``.
- ``moe_gating_topk`` / ``moe_dispatch`` / ``moe_combine``: ``kernels_cuda.moe_routing`` (warp gating top-k with
  torch's tie and summation order, counting-sort permute, fp32 weighted un-permute); else composed torch.
- ``grouped_mlp``: ``kernels_cuda.moe_gemm_swap`` for a few tokens (rows <= ``MOE_GEMM_SWAP_MAX_ROWS``; the
  SwiGLU fused into w13), ``kernels_cuda.moe_gemm`` for decode-sized batches (rows <= ``MOE_GEMM_MAX_ROWS``, at most
  ``MAX_EXPERTS`` = 256 experts), ``torch._grouped_mm`` (CUTLASS, device offsets) above; the reference loops over
  experts after ``tokens_per_expert.tolist()`` (a sync).
- ``sample`` / ``spec_verify`` / ``zos_fixup``: ``kernels_cuda.sampling`` / ``spec_verify`` / ``zos_fixup`` where
  their ``reason`` accepts the step; else the reference op on CUDA tensors (sync-free).
- ``decode_inputs``: ``kernels_cuda.decode_inputs`` (one launch) where its ``reason`` accepts the step; else the
  reference's torch ops (sync-free).
- ``linear``: ``kernels_cuda.skinny_gemm`` for one row (K <= 8192, no bias), else cuBLAS (the reference op).
- ``mla_epilogue``: W_UV of one token on ``skinny_gemm``'s grouped mode (the heads as experts;
  ``DEEPINFER_CUDA_SKINNY_W_UV=0``: cuBLAS), else cuBLAS' batched GEMM; o_proj through ``linear``.
- Still on reference ops running on CUDA tensors (sync-free): ``rope`` outside the prolog, ``copy_kv_blocks``.

The host max query length for the MLA kernel: the HAL's ``max_seqlen_q`` keyword (the model layer passes
``attn.max_seqlen_q``: k + 1 after a device re-split), else ``host.max_seqlen_q``, else the shape bound
``T - B + 1``, exact for decode without drafts (T == B) and valid whenever every request has at least one query
token, as the worker's rows always do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
from typing import Any

import torch

from deepinfer_npu.hal.kernel_set import KernelSet
from deepinfer_npu.hal.types import DispatchState, GatingParams, KernelWarmupPlan, MLAWeights, RopeLike

from . import mla_dense

logger = logging.getLogger(__name__)

KV_LORA, ROPE, PAGE = 512, 64, 64  # what kernels_cuda.mla_decode is built for (FlashMLA layout)
MAX_Q = 16  # query tokens per request the decode kernel handles (speculative verification)
# Rows (tokens x top-k) up to which grouped_mlp uses kernels_cuda.moe_gemm: it re-reads an expert's weight tile
# per 64-row block, so prefill-sized batches go to the library grouped GEMM.
MOE_GEMM_MAX_ROWS = 2048
# Rows (tokens x top-k) up to which grouped_mlp streams the experts with kernels_cuda.skinny_gemm (CUDA cores, the
# SwiGLU in the w13 epilogue) instead of moe_gemm's wgmma tiles: decode of a few tokens, one or two rows an expert.
# 0: off. Measured on an H200 (skinny_gemm --bench, session 4): at 1 token (6 rows) the grouped skinny w13 + w2
# took 24.1 + 11.9 us against moe_gemm's 22.0 + 11.9 (+ ~1.5 us of silu_mul), and lost more at 2 and 4 tokens.
SKINNY_GROUPED_MAX_ROWS = 0
# Rows (tokens x top-k) up to which grouped_mlp takes kernels_cuda.moe_gemm_swap (the weight tile as wgmma's M side,
# 8 or 16 token rows as its N side, SwiGLU in the w13 epilogue) instead of moe_gemm + silu_mul. Unverified: until
# its --check passes on a GPU the gate below keeps moe_gemm.
MOE_GEMM_SWAP_MAX_ROWS = 64
# run_parallel overlaps independent branches (shared experts | routed experts) on two streams;
# DEEPINFER_CUDA_PARALLEL_BRANCHES=0 runs them in order (A/B runs)
PARALLEL_BRANCHES = os.environ.get("DEEPINFER_CUDA_PARALLEL_BRANCHES", "1").strip() != "0"
# with PDL on, run_parallel keeps the branches in order up to this many token rows (parallel_branches)
SERIAL_BRANCHES_MAX_ROWS = 1
# mla_prolog's query and kv_a projections as one skinny_gemm launch for one row (MLAWeights.fused_a_proj);
# DEEPINFER_CUDA_FUSED_A_PROJ=0 runs the two launches (A/B runs)
FUSED_A_PROJ = os.environ.get("DEEPINFER_CUDA_FUSED_A_PROJ", "1").strip() != "0"
# mla_epilogue's W_UV at one token through skinny_gemm's grouped mode (_w_uv_skinny; checked against the fp32
# reference on an H200, tests/kernels_cuda/test_skinny_gemm.py): a TileLang kernel keeps the PDL chain that cuBLAS'
# batched GEMM breaks. On by default since session 7 (H200, batch 1, PDL on, two A/B pairs of 9 windows in one call:
# 434.3 / 433.4 tok/s against 424.5 / 425.9 with cuBLAS); DEEPINFER_CUDA_SKINNY_W_UV=0 keeps cuBLAS. Session 6 saw
# no gain beyond the spread of its (then host-bound, bimodal) batch-1 windows.
SKINNY_W_UV = os.environ.get("DEEPINFER_CUDA_SKINNY_W_UV", "1").strip() != "0"
# 64-row MLA decode tiles on kernels_cuda.mla_decode_ws (hand warp-specialized; Hopper only; its seesaw schedule
# since session 9, DEEPINFER_CUDA_MLA_SCHEDULE=ws the first one): 1.24-1.31x the pipelined kernel at 128 heads on an
# H200 (session 9); DEEPINFER_CUDA_MLA_WS=0 keeps the pipelined one (A/B runs)
MLA_WS = os.environ.get("DEEPINFER_CUDA_MLA_WS", "1").strip() != "0"
NORM_MIN, NORM_MAX, NORM_MULT = 512, 7168, 256  # widths kernels_cuda.rms_norm was checked at (one row in regs)

#: Reference ops that read device values on the host (a host-device sync per call on CUDA).
SYNCING_REFERENCE = {
    "mla_attention": "int(seqlens_q[b]) / int(seqlens_k[b]) per request",
    "grouped_mlp": "tokens_per_expert.tolist()",
    "mla_prolog": "boolean-mask cache write (slot_mapping >= 0)",
    "moe_dispatch": "torch.bincount (CUDA computes max() on the host)",
}

_STATIC_FALLBACK = {
    "copy_kv_blocks": "reference index_copy on CUDA tensors (fork copy-on-write); sync-free",
    "linear": "reference op on CUDA tensors: F.linear -> cuBLAS; sync-free",
    "rope": "reference op on CUDA tensors (gather + elementwise); sync-free",
    "mla_epilogue": "reference op on CUDA tensors: einsum (bmm) + F.linear; sync-free",
    "moe_gating_topk": "reference op on CUDA tensors (softmax/sigmoid + topk) where kernels_cuda.moe_routing does "
    "not apply; sync-free",
}

#: kernels_cuda modules written and compiled (sm_90a / sm_100a) but not yet checked on a GPU: their ops keep the
#: reference unless the environment sets ``DEEPINFER_CUDA_UNVERIFIED_KERNELS=1`` (read at every call). A new kernel
#: enters this set; it leaves once its ``--check`` has passed on the hardware. Session 3: zos_fixup, spec_verify,
#: sampling and mla_prefill passed their checks and engine tests on an H200 (kernels_cuda/NOTES.md); skinny_gemm
#: (session 4) entered and left it the same session after its check passed on an H200.
# moe_gemm_swap, moe_combine_add (the un-permute with the shared experts' output fused) and moe_dispatch_scan (the
# permute that also writes the expert GEMMs' scan), written in session 5 after its last device call, left it in
# session 6 after their checks ran on an H200: moe_routing.py --check passed; moe_gemm_swap.py --check passed in the
# 8 of 13 cases whose lines the log kept (kernels_cuda/NOTES.md, session 6, call 1; all 13 in session 7, call 1).
# decode_inputs and moe_route (the gating top-k fused with the permute), written after session 6's last device call,
# left it in session 7: decode_inputs.py --check, moe_routing.py --check (check_route) and their GPU tests passed on an
# H200 (kernels_cuda/NOTES.md, session 7, call 1).
# mla_absorb (W_UK of one token), written after session 7's last device call, left it in session 8: mla_absorb.py
# --check (6 cases, <= 2 bf16 ulp vs fp32, NaN/inf positions equal, graph replay) and the engine test passed on an H200.
# mla_decode_ws (the hand warp-specialized MLA decode for 64-row tiles), written in session 8, left it the same
# session: mla_decode_ws.py --check (15 cases, <= 1.67 bf16 ulp), the GPU tests and the engine test passed on an H200.
UNVERIFIED_KERNELS: set[str] = set()
UNVERIFIED_ENV = "DEEPINFER_CUDA_UNVERIFIED_KERNELS"


def unverified_note(module: str) -> str:
    """"; unverified, enabled by ..." for a gated module's op-report line, "" for a verified one."""
    return f"; unverified, enabled by {UNVERIFIED_ENV}=1" if module in UNVERIFIED_KERNELS else ""


def unverified_kernel_enabled(module: str) -> bool:
    """Whether ``kernels_cuda.<module>`` may run: verified, or enabled by ``DEEPINFER_CUDA_UNVERIFIED_KERNELS``:
    ``1`` (or true / yes / on) enables every gated module, a comma-separated list of names only those (A/B runs)."""
    import os

    if module not in UNVERIFIED_KERNELS:
        return True
    value = os.environ.get(UNVERIFIED_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    return module in {name.strip() for name in value.split(",")}


@functools.cache
def is_sm90(device_index: int) -> bool:
    """Hopper (compute capability 9.x): where the sm_90a-only kernels (wgmma issued by hand, setmaxnreg warpgroup
    roles: ``mla_decode_ws``) may run."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _ref(module: str):
    return importlib.import_module(f"deepinfer_npu.backends.cpu.{module}")


def tilelang_importable() -> bool:
    """Whether ``tilelang`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec("tilelang") is not None
    except (ImportError, ValueError):
        return False


class CudaKernelSet(KernelSet):
    FALLBACK_REASONS = dict(_STATIC_FALLBACK)

    def __init__(self) -> None:
        self.num_sms: int | None = None  # set by CudaBackend; read lazily otherwise
        # op -> {path description: (native?, syncs?)}; filled as ops are called
        self._paths: dict[str, dict[str, tuple[bool, bool]]] = {}
        self._calls = 0
        self._kernel_modules: dict[str, Any] = {}
        self._kernel_error: dict[str, str] = {}
        self._grouped_mm_error: str | None = None
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}  # run_parallel's second stream per device
        self._head_scans: dict[tuple, torch.Tensor] = {}  # _head_scan: (heads, device) -> constant scan
        # (counts, scan) of the last moe_dispatch that wrote the expert GEMMs' scan (moe_dispatch_scan)
        self._dispatch_scan: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _note(self, op: str, path: str, native: bool, syncs: bool = False) -> None:
        self._calls += 1
        d = self._paths.setdefault(op, {})
        if path not in d:
            d[path] = (native, syncs)
            if syncs:
                logger.info("cuda backend: %s takes a syncing path: %s", op, path)

    def has_run(self) -> bool:
        """True once any op has been called (the model's first forward decides which paths are taken)."""
        return self._calls > 0

    def syncing_ops(self) -> dict[str, list[str]]:
        """Ops that took a path reading device values on the host, with those paths."""
        return {op: [p for p, (_n, s) in d.items() if s] for op, d in self._paths.items() if any(
            s for _n, s in d.values())}

    def _kernel(self, name: str):
        """``deepinfer_npu.kernels_cuda.<name>`` when tilelang imports, else None (reason kept)."""
        if name in self._kernel_modules:
            return self._kernel_modules[name]
        mod = None
        if not tilelang_importable():
            self._kernel_error[name] = "tilelang is not installed (pip install tilelang==0.1.15)"
        else:
            try:
                mod = importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")
                if getattr(mod, "tilelang", None) is None:
                    self._kernel_error[name] = "tilelang failed to import"
                    mod = None
            except Exception as e:  # noqa: BLE001 - any import failure means: use the reference
                self._kernel_error[name] = f"kernels_cuda.{name} failed to import: {type(e).__name__}: {e}"
                mod = None
        self._kernel_modules[name] = mod
        return mod

    def _sms(self, device: torch.device) -> int:
        if self.num_sms is None:
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        return self.num_sms

    def warmup(self, plan: KernelWarmupPlan) -> str:
        """Compile every TileLang configuration the engine can reach for ``plan`` now, module by module, each in
        parallel threads (``backends/cuda/warmup.py``); a module that fails to compile is turned off here (its ops
        take the reference, with the reason). -> one-line summary, also logged."""
        from .warmup import warm_up

        if PARALLEL_BRANCHES and torch.cuda.is_available():  # run_parallel's stream, before any graph capture
            dev = torch.device("cuda", torch.cuda.current_device())
            self._side_streams.setdefault(dev, torch.cuda.Stream(device=dev))
        return warm_up(self, plan)

    # ---- concurrency ---------------------------------------------------------------------------------------
    def parallel_branches(self, rows: int | None) -> bool:
        """Whether ``run_parallel`` forks a second stream for ``rows`` token rows: not with PDL on at
        ``rows <= SERIAL_BRANCHES_MAX_ROWS`` (a stream fork / join is a full dependency, which breaks the
        programmatic launch chain; measured on an H200, session 6: batch 1 399.2 tok/s in order against 375.6 on
        two streams, both with PDL, while batch 16 drops from 1922.0 to 1837.2 in order); not without a device or
        with ``DEEPINFER_CUDA_PARALLEL_BRANCHES=0``."""
        from deepinfer_npu.kernels_cuda._pdl import pdl_enabled

        if not (PARALLEL_BRANCHES and torch.cuda.is_available()):
            return False
        return rows is None or rows > SERIAL_BRANCHES_MAX_ROWS or not pdl_enabled()

    def run_parallel(self, main, *side, rows: int | None = None):
        """With a CUDA device: the ``side`` branches on a second stream, forked from the current stream (event)
        and joined back before returning; inside graph capture this makes parallel branches of the graph. At
        batch 16 the routed experts' chain of one-CTA kernels (gating, permute) then runs next to the shared
        experts' GEMMs. In order where ``parallel_branches(rows)`` says so (batch 1 with PDL, no device,
        ``PARALLEL_BRANCHES`` off)."""
        if not (side and self.parallel_branches(rows)):
            return super().run_parallel(main, *side, rows=rows)
        cur = torch.cuda.current_stream()
        alt = self._side_streams.get(cur.device)
        if alt is None:
            if torch.cuda.is_current_stream_capturing():  # no stream creation inside a capture: in order this time
                return super().run_parallel(main, *side, rows=rows)
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
        self._note("run_parallel", "side branches on a second CUDA stream (fork/join events)", True)
        return [main_out, *side_out]

    # ---- norms ---------------------------------------------------------------------------------------------
    def _norm_reason(self, x: torch.Tensor, weight: torch.Tensor) -> str | None:
        n = x.shape[-1]
        if not x.is_cuda:
            return "tensor not on a CUDA device"
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return f"{x.dtype}: kernels_cuda.rms_norm is bf16-only"
        if not (NORM_MIN <= n <= NORM_MAX and n % NORM_MULT == 0):
            return f"width {n}: kernel checked for {NORM_MIN}..{NORM_MAX}, multiples of {NORM_MULT}"
        if x.numel() == 0:
            return "empty input"
        if self._kernel("rms_norm") is None:
            return self._kernel_error["rms_norm"]
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        why = self._norm_reason(x, weight)
        if why is not None:
            self._note("rms_norm", f"reference ({why})", False)
            return _ref("norm").rms_norm(x, weight, eps)
        self._note("rms_norm", f"kernels_cuda.rms_norm (bf16, N={x.shape[-1]})", True)
        return self._kernel("rms_norm").rms_norm(x.contiguous(), weight.contiguous(), float(eps))

    def add_rms_norm(self, x, residual, weight, eps):
        why = self._norm_reason(x, weight)
        if why is None and residual.dtype != torch.bfloat16:
            why = f"residual {residual.dtype}: kernel is bf16-only"
        if why is not None:
            self._note("add_rms_norm", f"reference ({why})", False)
            return _ref("norm").add_rms_norm(x, residual, weight, eps)
        self._note("add_rms_norm", f"kernels_cuda.rms_norm fused add (bf16, N={x.shape[-1]})", True)
        return self._kernel("rms_norm").add_rms_norm(
            x.contiguous(), residual.contiguous(), weight.contiguous(), float(eps)
        )

    # ---- dense ---------------------------------------------------------------------------------------------
    def _skinny(self, x2d: torch.Tensor, weight: torch.Tensor, gated: bool = False, grouped: bool = False):
        """(kernels_cuda.skinny_gemm, None) when it takes these operands, else (None, why)."""
        if not x2d.is_cuda:
            return None, "tensor not on a CUDA device"
        if not unverified_kernel_enabled("skinny_gemm"):
            return None, f"kernels_cuda.skinny_gemm is unverified (enable with {UNVERIFIED_ENV}=1)"
        mod = self._kernel("skinny_gemm")
        if mod is None:
            return None, self._kernel_error["skinny_gemm"]
        why = mod.reason(x2d, weight, gated, grouped) if grouped else mod.engine_reason(x2d, weight, gated)
        return (mod, None) if why is None else (None, why)

    def _note_skinny_linear(self, mod) -> None:
        self._note("linear", f"kernels_cuda.skinny_gemm (rows <= {mod.DENSE_MAX_ROWS}{unverified_note('skinny_gemm')})",
                   True)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """One row (batch-1 decode; ``skinny_gemm.engine_reason``: K <= DENSE_MAX_K, no bias):
        ``kernels_cuda.skinny_gemm`` (weights streamed by CUDA cores, one launch); else the reference (cuBLAS)."""
        x2d = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if bias is not None or x.dtype != weight.dtype:  # the reference's contract (F.linear): one dtype
            mod = None
        else:
            mod, _why = self._skinny(x2d, weight)
        if mod is None:
            self._note("linear", "reference", False)
            return _ref("linear").linear(x, weight, bias)
        self._note_skinny_linear(mod)
        return mod.skinny_gemm(x2d, weight).view(*x.shape[:-1], weight.shape[0])

    def router_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One bf16 row and an fp32 router: ``kernels_cuda.skinny_gemm`` on the bf16 row (exact fp32 conversion in
        the kernel, fp32 out), no cast launch; else ``linear(hidden.float(), weight)``."""
        mod, _why = self._skinny(hidden, weight) if hidden.dim() == 2 else (None, "not 2-D")
        if mod is None:
            return super().router_logits(hidden, weight)
        self._note_skinny_linear(mod)
        return mod.skinny_gemm(hidden, weight)

    def dense_mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Decode-sized row counts: the SwiGLU in the gate/up GEMM's epilogue (``skinny_gemm`` gated, the
        reference's roundings), then ``linear``; else ``linear`` + ``silu_and_mul`` + ``linear``."""
        mod, _why = self._skinny(x, gate_up, gated=True) if x.dim() == 2 else (None, "not 2-D")
        if mod is None:
            return super().dense_mlp(x, gate_up, down)
        self._note("silu_and_mul", f"kernels_cuda.skinny_gemm gated (SwiGLU in the gate/up GEMM, rows <= "
                   f"{mod.DENSE_MAX_ROWS}{unverified_note('skinny_gemm')})", True)
        self._note_skinny_linear(mod)
        return self.linear(mod.skinny_gemm(x, gate_up, gated=True), down)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``kernels_cuda.silu_mul`` (one kernel, the reference's bf16 rounding) for bf16 with I a multiple of 8;
        else the reference (2 elementwise kernels on CUDA tensors, sync-free)."""
        inter = x.shape[-1] // 2
        mod = None
        if not x.is_cuda:
            why = "tensor not on a CUDA device"
        elif x.dtype != torch.bfloat16:
            why = f"{x.dtype}: kernels_cuda.silu_mul is bf16-only"
        elif x.numel() == 0:
            why = "empty input"
        elif (mod := self._kernel("silu_mul")) is None:
            why = self._kernel_error["silu_mul"]
        elif x.shape[-1] % 2 or not mod.supported(inter):
            why = f"width {x.shape[-1]}: kernel needs 2*I with I a multiple of {mod.MULT}"
        else:
            why = None
        if why is not None:
            self._note("silu_and_mul", f"reference ({why})", False)
            return _ref("linear").silu_and_mul(x)
        self._note("silu_and_mul", f"kernels_cuda.silu_mul (bf16, I={inter})", True)
        return mod.silu_and_mul(x)

    def rope(self, x, positions, cos_sin_cache, interleaved):
        self._note("rope", "reference", False)
        return _ref("rope").rope(x, positions, cos_sin_cache, interleaved)

    # ---- MLA -----------------------------------------------------------------------------------------------
    def mla_prolog(
        self,
        hidden: torch.Tensor,
        w: MLAWeights,
        positions: torch.Tensor,
        rope: RopeLike,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's arithmetic (backends/cpu/mla.py). The tail after the projections (kv_a_layernorm, the
        two ropes, the cache write) is one ``kernels_cuda.mla_rope_cache`` launch for bf16 on the DeepSeek dims
        (same roundings; padding rows write nothing). Otherwise composed torch, with the norms on this kernel set
        and a cache write that needs no host read: padding rows (negative slots) rewrite slot 0 (block 0, the
        reserved padding block that no sequence owns) with its own current contents, so nothing visible changes."""
        lin, apply_rope = self.linear, _ref("rope").rope
        num_tokens = hidden.shape[0]
        nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank

        def q_branch(first=None):  # first: the query's first projection, already computed
            if w.q_proj is not None:
                q = lin(hidden, w.q_proj) if first is None else first
            else:
                qa = lin(hidden, w.q_a_proj, w.q_a_bias) if first is None else first
                q = lin(self.rms_norm(qa, w.q_a_layernorm, w.norm_eps), w.q_b_proj)
            q = q.view(num_tokens, w.num_heads, nope + rdim)
            return q, self._absorb_q(q, w)

        fused = self._fused_a_proj(hidden, w)
        if fused is not None:  # one skinny launch for both projections (each column as in its own GEMM)
            first, kv = fused
            q, q_latent = q_branch(first)
        else:  # the latent projection does not wait for the query's GEMMs (a second stream at decode sizes)
            (q, q_latent), kv = self.run_parallel(q_branch, lambda: lin(hidden, w.kv_a_proj, w.kv_a_bias),
                                                  rows=num_tokens)
        q_pe = q[..., nope:]
        bf16, mod = torch.bfloat16, None
        if not kv.is_cuda:
            why = "tensor not on a CUDA device"
        elif any(t.dtype != bf16 for t in (q, kv, kv_cache, w.kv_a_layernorm)):
            why = f"{kv.dtype} (cache {kv_cache.dtype}): kernels_cuda.mla_rope_cache is bf16-only"
        elif lrank != KV_LORA or rdim != ROPE:
            why = f"kv_lora {lrank} + rope {rdim}: kernel built for the DeepSeek dims {KV_LORA} + {ROPE}"
        elif kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or not kv_cache.is_contiguous():
            why = f"cache block {tuple(kv_cache.shape[1:])}, contiguous={kv_cache.is_contiguous()}: kernel writes " \
                f"contiguous pages of {PAGE}"
        elif rope.cos_sin_cache.dtype != torch.float32 or rope.cos_sin_cache.shape[-1] != rdim:
            why = f"cos_sin_cache {rope.cos_sin_cache.dtype} width {rope.cos_sin_cache.shape[-1]}: kernel reads fp32 " \
                f"rows of {ROPE}"
        elif (mod := self._kernel("mla_rope_cache")) is None:
            why = self._kernel_error["mla_rope_cache"]
        elif not mod.supported_heads(w.num_heads):
            why = f"H={w.num_heads}: kernel rotates 16 heads a CTA (H a multiple of 16, or 1, 2, 4, 8)"
        else:
            why = None
        if why is None:
            self._note(
                "mla_prolog",
                f"kernels_cuda.mla_rope_cache (bf16, H={w.num_heads}, interleaved={bool(rope.interleaved)}): "
                "kv_a_layernorm + ropes + sync-free cache write in one kernel",
                True,
            )
            q_rope = mod.mla_rope_cache(
                kv, w.kv_a_layernorm, float(w.norm_eps), q, nope, positions, rope.cos_sin_cache, rope.interleaved,
                kv_cache, slot_mapping,
            )
            return q_latent, q_rope
        self._note("mla_prolog", f"composed torch, sync-free cache write ({why})", True)
        q_rope = apply_rope(q_pe, positions, rope.cos_sin_cache, rope.interleaved)
        c_kv, k_pe = kv.split([lrank, rdim], dim=-1)
        c_kv = self.rms_norm(c_kv, w.kv_a_layernorm, w.norm_eps)
        k_pe = apply_rope(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
        if num_tokens:
            write_kv_cache_sync_free(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping)
        return q_latent, q_rope

    def _absorb_q(self, q: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        """W_UK of the query: ``kernels_cuda.mla_absorb`` for one bf16 token (a TileLang kernel, so the programmatic
        launch chain goes on; checked on an H200 in session 8, on unless put back into the gate); else cuBLAS'
        batched GEMM (``absorb_heads``, the reference's arithmetic)."""
        if q.shape[0] == 1:
            mod, path = self._gated_kernel("mla_absorb", q, q, w.w_uk)
            if mod is not None:
                self._note("mla_prolog", f"W_UK of one token: kernels_cuda.mla_absorb{unverified_note('mla_absorb')}",
                           True)
                return mod.absorb_q(q, w.w_uk)
            self._note("mla_prolog", f"W_UK of one token: cuBLAS batched GEMM ({path})", False)
        return absorb_heads(q[..., : w.qk_nope_head_dim], w.w_uk)

    def _fused_a_proj(self, hidden: torch.Tensor, w: MLAWeights):
        """One row and ``w.fused_a_proj`` set: one ``skinny_gemm`` launch for the query's first projection and
        kv_a (q_proj or q_a_proj, then kv_a_proj: the same input) -> (first, kv) views of its output; None where
        it does not apply. skinny_gemm computes each output column alone (a warp per column, the same K order), so
        the columns are bit-identical to the two separate launches."""
        fused = w.fused_a_proj
        if not FUSED_A_PROJ or fused is None or hidden.dim() != 2 or hidden.shape[0] != 1 or \
                hidden.dtype != fused.dtype or w.q_a_bias is not None or w.kv_a_bias is not None:
            return None
        mod, _why = self._skinny(hidden, fused)
        if mod is None:
            return None
        self._note_skinny_linear(mod)
        self._note("mla_prolog", "q / q_a and kv_a projections: one kernels_cuda.skinny_gemm launch (fused_a_proj)",
                   True)
        flat, rows = mod.skinny_gemm(hidden, fused).view(-1), fused.shape[0] - w.kv_a_proj.shape[0]
        # views with their own compact strides (a split's [1, n] views would keep the fused row stride)
        return flat[:rows].view(1, rows), flat[rows:].view(1, w.kv_a_proj.shape[0])

    def _attn_reason(self, q_latent, q_rope, kv_cache, block_tables, max_q: int) -> str | None:
        lrank, rdim = q_latent.shape[-1], q_rope.shape[-1]
        if not q_latent.is_cuda:
            return "tensor not on a CUDA device"
        if q_latent.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or q_rope.dtype != torch.bfloat16:
            return f"{q_latent.dtype}: kernels_cuda.mla_decode is bf16-only"
        if lrank != KV_LORA or rdim != ROPE:
            return f"kv_lora {lrank} + rope {rdim}: kernel built for the DeepSeek dims {KV_LORA} + {ROPE}"
        if kv_cache.shape[1] != PAGE:
            return f"block_size {kv_cache.shape[1]}: kernel reads pages of {PAGE}"
        if block_tables.shape[0] == 0:
            return "no requests"
        if not 1 <= max_q <= MAX_Q:
            return f"prefill (max query length {max_q} > {MAX_Q})"
        if self._kernel("mla_decode") is None:
            return self._kernel_error["mla_decode"]
        return None

    def mla_attention(
        self,
        q_latent,
        q_rope,
        kv_cache,
        block_tables,
        seqlens_q,
        seqlens_k,
        cu_seqlens_q,
        softmax_scale,
        host=None,
        max_seqlen_q: int | None = None,
    ) -> torch.Tensor:
        """``max_seqlen_q``: the host max query length (``AttentionMetadata.max_seqlen_q``); when not given,
        the shape bound ``T - B + 1`` (every request has >= 1 query token)."""
        num_tokens, num_reqs = q_latent.shape[0], block_tables.shape[0]
        if max_seqlen_q is None and host is not None:
            max_seqlen_q = host.max_seqlen_q
        max_q = int(max_seqlen_q) if max_seqlen_q is not None else num_tokens - num_reqs + 1
        why = self._attn_reason(q_latent, q_rope, kv_cache, block_tables, max_q)
        if why is not None and max_q > MAX_Q and unverified_kernel_enabled("mla_prefill"):
            # prefill on the same TileLang kernel (causal tile bound, no split)
            pre_why = self._attn_reason(q_latent, q_rope, kv_cache, block_tables, 1)
            mod = self._kernel("mla_decode") if pre_why is None else None
            if mod is not None and max_q <= mod.MAX_PREFILL_Q:
                self._note("mla_attention", f"kernels_cuda.mla_decode.mla_prefill (bf16, H={q_latent.shape[1]}, "
                           f"q<= {mod.bucket_prefill_q(max_q)}{unverified_note('mla_prefill')})", True)
                i32 = torch.int32
                out, _lse = mod.mla_prefill(q_latent.contiguous(), q_rope.contiguous(), kv_cache,
                                            block_tables.to(i32).contiguous(), seqlens_q.to(i32),
                                            seqlens_k.to(i32), cu_seqlens_q.to(i32), float(softmax_scale),
                                            max_seqlen_q=max_q)
                return out
        if why is not None and q_latent.is_cuda and 1 <= max_q <= MAX_Q and block_tables.shape[0] > 0 and (
            torch.cuda.is_current_stream_capturing()
            or mla_dense.gather_bytes(q_latent, kv_cache, block_tables) <= mla_dense.MAX_GATHER_BYTES
        ):  # decode / verification off the kernel's shapes: composed torch, sync-free (graph-capturable)
            self._note("mla_attention", f"composed torch dense decode, sync-free ({why})", False)
            return mla_dense.mla_attention_dense(
                q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
            )
        if why is not None and host is not None and host.seqlens_k_exact and len(host.seqlens_q) == num_reqs:
            # prefill (or any step whose lengths the host knows exactly): the reference loop on host ints
            self._note("mla_attention", f"reference arithmetic on host lengths, sync-free ({why})", False)
            return _ref("mla").mla_attention(q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k,
                                             cu_seqlens_q, softmax_scale, host=host)
        if why is not None:
            self._note("mla_attention", f"reference ({why})", False, syncs=q_latent.is_cuda)
            with known_syncing_fallback():
                return _ref("mla").mla_attention(
                    q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
                )
        mod = self._kernel("mla_decode")
        ws = MLA_WS and unverified_kernel_enabled("mla_decode_ws") and is_sm90(q_latent.device.index or 0)
        ws_note = ""
        if ws and mod.decode_block_m(q_latent.shape[1], mod.bucket_q(max_q)) == mod.BLOCK_M:
            off = mod._ws_module().disabled_reason
            ws_note = (f"; warp-specialized (mla_decode_ws{unverified_note('mla_decode_ws')})" if off is None
                       else f"; pipelined 64-row tile (mla_decode_ws off: {off})")
        self._note(
            "mla_attention",
            f"kernels_cuda.mla_decode (bf16, H={q_latent.shape[1]}, q<= {mod.bucket_q(max_q)}{ws_note})",
            True,
        )
        i32 = torch.int32
        out, _lse = mod.mla_decode(
            q_latent.contiguous(),
            q_rope.contiguous(),
            kv_cache,
            block_tables.to(i32).contiguous(),
            seqlens_q.to(i32),
            seqlens_k.to(i32),
            cu_seqlens_q.to(i32),
            float(softmax_scale),
            max_seqlen_q=max_q,
            num_sms=self._sms(q_latent.device),
            warp_specialized=ws,
        )
        return out

    def _head_scan(self, num_heads: int, device) -> torch.Tensor | None:
        """``moe_gemm.expert_starts``' layout for one row a head ([0 .. H], then heads 0 .. H-1), made once per
        (H, device) outside graph capture (the capture's eager warm-up run makes it); None inside a capture."""
        key = (num_heads, str(device))
        scan = self._head_scans.get(key)
        if scan is None and not torch.cuda.is_current_stream_capturing():  # built on the device: no host copy (sync)
            idx = torch.arange(num_heads + 1, dtype=torch.int32, device=device)
            scan = self._head_scans[key] = torch.cat([idx, idx[:-1]])
        return scan

    def _w_uv_skinny(self, out_latent: torch.Tensor, w: MLAWeights):
        """W_UV for one token through ``skinny_gemm``'s grouped mode, the heads as its experts (one row each):
        a TileLang kernel, so the programmatic launch chain goes on (cuBLAS' batched GEMM breaks it). None where
        it does not apply (more tokens, other dtypes, ``SKINNY_W_UV`` off)."""
        if not (SKINNY_W_UV and out_latent.is_cuda and out_latent.shape[0] == 1):
            return None
        a = out_latent.reshape(out_latent.shape[1], out_latent.shape[2])  # [H, L]: one row a head, head-major
        sk, _why = self._skinny(a, w.w_uv, grouped=True)
        scan = self._head_scan(a.shape[0], a.device) if sk is not None and a.dtype == torch.bfloat16 else None
        if scan is None:
            return None
        self._note("mla_epilogue", "W_UV: kernels_cuda.skinny_gemm grouped (the heads as experts, 1 token) + "
                   "linear (o_proj)", True)
        return sk.skinny_gemm(a, w.w_uv, scan=scan).view(1, -1)

    def mla_epilogue(self, out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
        """One token (batch-1 decode, bf16): W_UV through ``kernels_cuda.skinny_gemm`` (``_w_uv_skinny``); else the
        reference's arithmetic (W_UV per head on cuBLAS: ``absorb_heads``). o_proj through this set's ``linear``."""
        values = self._w_uv_skinny(out_latent, w)
        if values is None:
            self._note("mla_epilogue", "reference arithmetic: W_UV per head (cuBLAS) + linear (o_proj)", False)
            values = absorb_heads(out_latent, w.w_uv.transpose(1, 2))
        return self.linear(values.reshape(values.shape[0], -1), w.o_proj, w.o_bias)

    # ---- MoE -----------------------------------------------------------------------------------------------
    def moe_gating_topk(self, router_logits, bias, params: GatingParams):
        """``kernels_cuda.moe_routing.gating_topk`` (one kernel: scores, group limit, top-k in torch.topk's CUDA
        order, normalisation, scaling) for E % 32 == 0, E <= 256, k <= 16; else the reference on CUDA tensors
        (softmax/sigmoid + topk, sync-free)."""
        mod = None
        if not router_logits.is_cuda:
            why = "tensor not on a CUDA device"
        elif (mod := self._kernel("moe_routing")) is None:
            why = self._kernel_error["moe_routing"]
        else:
            why = mod.gating_reason(router_logits, bias, params)
        if why is not None:
            self._note("moe_gating_topk", f"reference ({why})", False)
            return _ref("moe").moe_gating_topk(router_logits, bias, params)
        self._note(
            "moe_gating_topk",
            f"kernels_cuda.moe_routing gating ({params.scoring_func}/{params.topk_method}, E={params.num_experts}, "
            f"k={params.top_k})",
            True,
        )
        return mod.gating_topk(router_logits, bias, params)

    def moe_route(self, router_logits, bias, params: GatingParams, hidden, num_experts: int):
        """Decode sizes (T <= the kernel's MAX_ROUTE_TOKENS; gate: ``moe_route``): ``kernels_cuda.moe_routing.route``,
        the gating top-k and the permute (with the expert GEMMs' scan) in one launch, bit-identical to the two
        kernels; else ``moe_gating_topk`` then ``moe_dispatch``."""
        mod = None
        if unverified_kernel_enabled("moe_route") and hidden.is_cuda:
            mod = self._kernel("moe_routing")
        if mod is None or not hasattr(mod, "route") or mod.route_reason(router_logits, bias, params, hidden,
                                                                        num_experts) is not None:
            return super().moe_route(router_logits, bias, params, hidden, num_experts)
        path = (f"kernels_cuda.moe_routing route (gating + permute + scan in one launch, {params.scoring_func}/"
                f"{params.topk_method}, E={num_experts}, k={params.top_k}{unverified_note('moe_route')})")
        self._note("moe_gating_topk", path, True)
        self._note("moe_dispatch", path, True)
        weights, ids, sorted_hidden, counts, order, scan = mod.route(router_logits, bias, params, hidden, num_experts)
        self._dispatch_scan = (counts, scan)  # for grouped_mlp, which receives these counts next (identity-checked)
        return weights, ids, sorted_hidden, counts, DispatchState(order=order, num_tokens=ids.shape[0],
                                                                  top_k=ids.shape[1])

    def moe_dispatch(self, hidden, ids, num_experts: int):
        """``kernels_cuda.moe_routing.permute`` (one kernel: counting sort by expert = the reference's stable
        argsort, the counts and the gathered rows) for bf16 / fp32 with T*k <= its MAX_ASSIGN (decode); else the
        reference's stable sort with expert counts by ``scatter_add_`` (CUDA ``bincount`` syncs). Both sync-free."""
        mod = None
        if not hidden.is_cuda:
            why = "tensor not on a CUDA device"
        elif (mod := self._kernel("moe_routing")) is None:
            why = self._kernel_error["moe_routing"]
        else:
            why = mod.permute_reason(hidden, ids, num_experts)
        if why is None:
            self._note(
                "moe_dispatch",
                f"kernels_cuda.moe_routing permute ({str(hidden.dtype).removeprefix('torch.')}, k={ids.shape[1]}, "
                f"E={num_experts}), sync-free",
                True,
            )
            if unverified_kernel_enabled("moe_dispatch_scan") and num_experts <= mod.MAX_SCAN_EXPERTS:
                # the expert GEMMs' scan from the same launch (no expert_scan kernel): kept for grouped_mlp,
                # which receives these counts next (identity-checked there)
                sorted_hidden, counts, order, scan = mod.permute(hidden, ids, num_experts, with_scan=True)
                self._dispatch_scan = (counts, scan)
            else:
                sorted_hidden, counts, order = mod.permute(hidden, ids, num_experts)
            return sorted_hidden, counts, DispatchState(order=order, num_tokens=ids.shape[0], top_k=ids.shape[1])
        self._note("moe_dispatch", f"composed torch (stable argsort + scatter_add counts), sync-free ({why})", True)
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1).long()
        order = torch.argsort(flat_ids, stable=True)
        sorted_hidden = hidden.index_select(0, order // top_k)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        return sorted_hidden, counts, DispatchState(order=order, num_tokens=num_tokens, top_k=top_k)

    def _grouped_mm_reason(self, sorted_hidden, w13, w2) -> str | None:
        if not sorted_hidden.is_cuda:
            return "tensor not on a CUDA device"
        if not hasattr(torch, "_grouped_mm"):
            return f"torch {torch.__version__} has no torch._grouped_mm"
        if self._grouped_mm_error is not None:
            return self._grouped_mm_error
        if sorted_hidden.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            return f"{sorted_hidden.dtype}: torch._grouped_mm path is bf16-only"
        d, inter = w13.shape[2], w2.shape[2]
        if d % 8 or inter % 8:  # 16-byte row alignment of A, B and the intermediate
            return f"D={d}, I={inter}: grouped GEMM needs multiples of 8"
        return None

    def _moe_gemm_for(self, sorted_hidden, w13, w2):
        """``kernels_cuda.moe_gemm`` when it fits (bf16 on CUDA, decode-sized row counts, tile-aligned dims)."""
        rows = sorted_hidden.shape[0]
        if not (sorted_hidden.is_cuda and 0 < rows <= MOE_GEMM_MAX_ROWS):
            return None
        if not (sorted_hidden.dtype == w13.dtype == w2.dtype == torch.bfloat16):
            return None
        mod = self._kernel("moe_gemm")
        if mod is None or not (mod.supported(w13.shape[1], w13.shape[2]) and mod.supported(w2.shape[1], w2.shape[2])):
            return None
        if w13.shape[0] > getattr(mod, "MAX_EXPERTS", w13.shape[0]):  # expert_scan: one thread an expert
            return None
        return mod

    def _expert_starts(self, mg, tokens_per_expert):
        """``moe_gemm.expert_starts(tokens_per_expert)``, or the scan ``moe_dispatch`` wrote with these very counts
        (``moe_dispatch_scan``: one launch a layer fewer)."""
        stash, self._dispatch_scan = self._dispatch_scan, None  # used once: nothing kept alive past the layer
        if stash is not None and stash[0] is tokens_per_expert:
            return stash[1]
        return mg.expert_starts(tokens_per_expert)

    def _moe_gemm_swap_for(self, w13, w2):
        """``kernels_cuda.moe_gemm_swap`` where ``_moe_gemm_for`` applies, its dims fit and the gate allows it."""
        if not unverified_kernel_enabled("moe_gemm_swap"):
            return None
        mod = self._kernel("moe_gemm_swap")
        if mod is None or not (mod.supported(w13.shape[1], w13.shape[2], True)
                               and mod.supported(w2.shape[1], w2.shape[2], False)):
            return None
        return mod

    def grouped_mlp(self, sorted_hidden, tokens_per_expert, w13, w2):
        """Decode-sized batches (rows <= MOE_GEMM_MAX_ROWS): ``kernels_cuda.moe_gemm`` (one CTA per expert and N
        tile streaming the hit experts' weights; 1.2-1.5x torch._grouped_mm on an H200); larger batches:
        ``torch._grouped_mm`` (CUTLASS); else the reference (syncs)."""
        rows = sorted_hidden.shape[0]  # host int: the dispatched rows (tokens x top-k)
        mg = self._moe_gemm_for(sorted_hidden, w13, w2)
        sk = None
        if mg is not None and rows <= SKINNY_GROUPED_MAX_ROWS:  # off (0) until it beats moe_gemm
            sk, _why = self._skinny(sorted_hidden, w13, gated=True, grouped=True)
        if sk is not None:  # a row or two an expert: CUDA-core streams, SwiGLU fused into w13 (2 launches + scan)
            starts = self._expert_starts(mg, tokens_per_expert)
            h = sk.skinny_gemm(sorted_hidden, w13, gated=True, scan=starts)
            out = sk.skinny_gemm(h, w2, scan=starts)
            self._note("grouped_mlp", f"kernels_cuda.skinny_gemm grouped (rows <= {SKINNY_GROUPED_MAX_ROWS}, "
                       f"SwiGLU in the w13 epilogue{unverified_note('skinny_gemm')})", True)
            return out
        sw = self._moe_gemm_swap_for(w13, w2) if mg is not None and rows <= MOE_GEMM_SWAP_MAX_ROWS else None
        if sw is not None:  # a few rows an expert: weight tiles on wgmma's M side, SwiGLU fused (2 launches + scan)
            starts = self._expert_starts(mg, tokens_per_expert)
            h = sw.moe_gemm_swap(sorted_hidden, w13, starts, gated=True)
            out = sw.moe_gemm_swap(h, w2, starts)
            self._note("grouped_mlp", f"kernels_cuda.moe_gemm_swap (bf16, rows <= {MOE_GEMM_SWAP_MAX_ROWS}, SwiGLU "
                       f"in the w13 epilogue{unverified_note('moe_gemm_swap')})", True)
            return out
        if mg is not None:
            starts = self._expert_starts(mg, tokens_per_expert)  # once for both GEMMs
            h = mg.moe_gemm(sorted_hidden, w13, tokens_per_expert, starts=starts)
            h = self.silu_and_mul(h)
            out = mg.moe_gemm(h, w2, tokens_per_expert, starts=starts)
            self._note("grouped_mlp", f"kernels_cuda.moe_gemm (bf16, rows <= {MOE_GEMM_MAX_ROWS})", True)
            return out
        why = self._grouped_mm_reason(sorted_hidden, w13, w2)
        if why is None and rows > 0:
            try:
                offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
                h = torch._grouped_mm(sorted_hidden.contiguous(), w13.transpose(1, 2), offs=offs)
                h = self.silu_and_mul(h)
                out = torch._grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs)
                self._note("grouped_mlp", "torch._grouped_mm (bf16 grouped GEMM, device offsets)", True)
                return out
            except Exception as e:  # noqa: BLE001 - disable for good, run the reference
                self._grouped_mm_error = f"torch._grouped_mm failed: {type(e).__name__}: {str(e)[:160]}"
                logger.warning("cuda backend: %s; grouped_mlp falls back to the reference", self._grouped_mm_error)
                why = self._grouped_mm_error
        self._note("grouped_mlp", f"reference ({why or 'empty'})", False, syncs=sorted_hidden.is_cuda)
        with known_syncing_fallback():
            return _ref("moe").grouped_mlp(sorted_hidden, tokens_per_expert, w13, w2)

    def moe_combine(self, expert_out, state: DispatchState, weights):
        """``kernels_cuda.moe_routing.unpermute`` (one kernel: the un-permute and the fp32 weighted sum in torch's
        summation order, one rounding) for bf16 / fp32 with T*k <= its MAX_ASSIGN; else the reference's arithmetic
        with ``index_copy_`` for the un-permute. Both sync-free."""
        mod = None
        if not expert_out.is_cuda:
            why = "tensor not on a CUDA device"
        elif (mod := self._kernel("moe_routing")) is None:
            why = self._kernel_error["moe_routing"]
        else:
            why = mod.unpermute_reason(expert_out, state.order, weights, state.num_tokens, state.top_k)
        if why is None:
            self._note(
                "moe_combine",
                f"kernels_cuda.moe_routing unpermute ({str(expert_out.dtype).removeprefix('torch.')}, "
                f"k={state.top_k}), sync-free",
                True,
            )
            return mod.unpermute(expert_out, state.order, weights, state.num_tokens, state.top_k)
        self._note("moe_combine", f"composed torch (index_copy_ + weighted sum in fp32), sync-free ({why})", True)
        unsorted = torch.empty_like(expert_out, dtype=torch.float32)
        unsorted.index_copy_(0, state.order, expert_out.float())
        per_token = unsorted.view(state.num_tokens, state.top_k, -1)
        return (per_token * weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)

    def moe_combine_add(self, expert_out, state: DispatchState, weights, addend):
        """``kernels_cuda.moe_routing.unpermute`` with the addend fused (the shared experts' output: one launch
        instead of the combine and an add; the same roundings) where the plain combine kernel applies and the
        gate allows it (``moe_combine_add`` in ``UNVERIFIED_KERNELS``); else the combine, then torch's add."""
        mod = None
        if unverified_kernel_enabled("moe_combine_add") and expert_out.is_cuda:
            mod = self._kernel("moe_routing")
        if mod is not None and (
            mod.unpermute_reason(expert_out, state.order, weights, state.num_tokens, state.top_k) is None
            and mod.addend_reason(expert_out, addend, state.num_tokens) is None
        ):
            self._note("moe_combine", f"kernels_cuda.moe_routing unpermute + addend ({str(expert_out.dtype)[6:]}, "
                       f"k={state.top_k}), sync-free{unverified_note('moe_combine_add')}", True)
            return mod.unpermute(expert_out, state.order, weights, state.num_tokens, state.top_k, addend=addend)
        return super().moe_combine_add(expert_out, state, weights, addend)

    # ---- sampling / speculative decoding -------------------------------------------------------------------
    def _gated_kernel(self, module: str, x: torch.Tensor, *reason_args):
        """(kernel module, None) when ``kernels_cuda.<module>`` may run on ``x`` and its ``reason(*reason_args)``
        accepts the call, else (None, path); the path is "reference (...)" with why (gated as unverified in
        ``UNVERIFIED_KERNELS``, not on a device, not importable, or the module's reason)."""
        if not unverified_kernel_enabled(module):
            return None, f"reference (kernels_cuda.{module} not yet verified on a GPU: {UNVERIFIED_ENV}=1 enables it)"
        if not x.is_cuda:
            return None, "reference (tensor not on a CUDA device)"
        mod = self._kernel(module)
        if mod is None:
            return None, f"reference ({self._kernel_error[module]})"
        if reason_args and (why := mod.reason(*reason_args)) is not None:
            return None, f"reference ({why})"
        return mod, None

    def sample(self, logits: torch.Tensor, sampling_tensors: Any) -> Any:
        """``kernels_cuda.sampling`` (greedy and temperature rows, hash-RNG Gumbel noise bit-identical to the
        reference; two launches) and no top-k /
        top-p, logprobs or bans; else the reference sampler on CUDA tensors."""
        t = sampling_tensors
        mod, path = self._gated_kernel("sampling", logits, logits, t)
        if mod is None:
            self._note("sample", path, False)
            return _ref("sampling").sample(logits, t)
        from deepinfer_npu.sampling.metadata import SamplerOutput

        kind = "greedy" if t.all_greedy else "greedy / temperature, seeded"
        self._note("sample", f"kernels_cuda.sampling ({kind}{unverified_note('sampling')})", True)
        return SamplerOutput(token_ids=mod.sample(logits, t, num_sms=self._sms(logits.device)), logprobs=None)

    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        """``kernels_cuda.spec_verify`` (row arg-max + one accept kernel) for all-greedy steps, and for
        temperature rows without drafts (max_q == 1), without logprobs, bans or top-k / top-p; else the reference
        op on CUDA tensors."""
        mod, path = self._gated_kernel("spec_verify", logits, logits, draft_next, row_of_token, j_of_token, num_rows,
                                       max_q, t, ban_mask)
        if mod is None:
            self._note("spec_verify", path, False)
            return _ref("spec_verify").spec_verify(logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t,
                                                   ban_mask)
        kind = "greedy" if t.all_greedy else "greedy / temperature rows without drafts, seeded"
        self._note("spec_verify", f"kernels_cuda.spec_verify ({kind}{unverified_note('spec_verify')})", True)
        emitted, num_emitted, accepted, target = mod.spec_verify(
            logits, draft_next, row_of_token, j_of_token, num_rows, max_q, t, num_sms=self._sms(logits.device)
        )
        return _ref("spec_verify").VerifyOutput(emitted=emitted, num_emitted=num_emitted, accepted=accepted,
                                                target_tokens=target, logprobs=None)

    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        """``kernels_cuda.zos_fixup`` (one launch: the seqlens_k correction, and the varlen re-split by a block-wide
        threshold search); else the reference."""
        mod, path = self._gated_kernel("zos_fixup", seqlens_k, seqlens_q, seqlens_k, optimistic, slots, correction,
                                       draft_probs, caps)
        if mod is None:
            self._note("zos_fixup", path, False)
            return _ref("zos").zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)
        kind = "correction + re-split" if draft_probs is not None and caps is not None else "correction"
        self._note("zos_fixup", f"kernels_cuda.zos_fixup ({kind}{unverified_note('zos_fixup')})", True)
        return mod.zos_fixup(seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs, caps)

    def decode_inputs(self, seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts,
                      block_size: int, num_tokens: int):
        """``kernels_cuda.decode_inputs`` (one launch for the ~45 small torch ops of the reference; checked on an H200
        in session 7); else the reference (``backends/cpu/step_inputs.py``), sync-free."""
        args = (seqlens_q, seqlens_k, block_tables, state_slots, first_ids, last_token, drafts)
        mod, path = self._gated_kernel("decode_inputs", seqlens_q, *args, block_size, num_tokens)
        if mod is None:
            self._note("decode_inputs", path, False)
            return _ref("step_inputs").decode_inputs(*args, block_size, num_tokens)
        self._note("decode_inputs", f"kernels_cuda.decode_inputs (one launch{unverified_note('decode_inputs')})", True)
        return mod.decode_inputs(*args, block_size, num_tokens, check=False)  # reason() just passed

    # ---- reporting -----------------------------------------------------------------------------------------
    PLANNED = {
        "decode_inputs": "kernels_cuda.decode_inputs (one launch) where its reason accepts the step; else the "
        "reference's torch ops (sync-free)",
        "linear": "kernels_cuda.skinny_gemm for 1-row steps (K <= 8192, no bias); else F.linear on cuBLAS",
        "rms_norm": "kernels_cuda.rms_norm for bf16, width 512..7168 (x256); else the reference",
        "add_rms_norm": "kernels_cuda.rms_norm (fused add) for bf16, width 512..7168 (x256); else the reference",
        "mla_prolog": "kernels_cuda.mla_rope_cache (kv_a_layernorm + both ropes + cache write in one kernel) for "
        "bf16, kv_lora 512 + rope 64, page 64; else composed torch with a sync-free cache write; for one row the "
        "q / q_a and kv_a projections as one skinny_gemm launch (fused_a_proj) and W_UK on kernels_cuda.mla_absorb",
        "silu_and_mul": "kernels_cuda.silu_mul for bf16 with I a multiple of 8; else the reference (sync-free)",
        "mla_attention": "kernels_cuda.mla_decode for bf16, kv_lora 512 + rope 64, page 64, max q <= 16 (64-row "
        "tiles on sm_90 through kernels_cuda.mla_decode_ws, warp-specialized); "
        "else decode (max q <= 16) in composed torch (dense, sync-free); "
        "prefill (max q > 16) on kernels_cuda.mla_decode.mla_prefill (causal tile bound) for the same shapes, "
        "else on the host's exact lengths (the reference loop, sync-free); else the reference (syncs)",
        "moe_gating_topk": "kernels_cuda.moe_routing gating (one kernel) for E % 32 == 0, E <= 256, k <= 16; "
        "else the reference (softmax/sigmoid + topk, sync-free)",
        "moe_dispatch": "kernels_cuda.moe_routing permute (counting sort, one kernel) for bf16 / fp32 with T*k <= "
        "8192; else composed torch (stable argsort + scatter_add); sync-free",
        "grouped_mlp": f"kernels_cuda.moe_gemm for bf16 with rows <= {MOE_GEMM_MAX_ROWS}; torch._grouped_mm for larger "
        "bf16 batches; else the reference (syncs)",
        "moe_combine": "kernels_cuda.moe_routing unpermute (one kernel) for bf16 / fp32 with T*k <= 8192; else "
        "composed torch (index_copy_ + weighted sum); sync-free",
        "sample": "kernels_cuda.sampling for greedy / temperature rows (seeded hash-RNG Gumbel race) without top-k / "
        "top-p, logprobs or bans; else the reference sampler on CUDA tensors (sync-free)",
        "spec_verify": "kernels_cuda.spec_verify (split arg-max + accept) for greedy steps and temperature rows "
        "without drafts, no logprobs / bans / top-k / top-p; else the reference op on CUDA tensors (sync-free)",
        "zos_fixup": "kernels_cuda.zos_fixup (seqlens_k correction, varlen re-split) in one launch; else the "
        "reference op on CUDA tensors (sync-free)",
    }

    def op_report(self) -> dict[str, str]:
        """Per op: ``native (...)`` when every call so far took a native path, ``fallback (...)`` when every
        call took the reference, ``native (...; fallback for ...)`` when both happened; before the first call,
        the planned decision."""
        report = {}
        for op in self.OPS:
            paths = self._paths.get(op)
            if not paths:
                if op in self.PLANNED:
                    report[op] = f"pending ({self.PLANNED[op]})"
                else:
                    report[op] = f"fallback ({_STATIC_FALLBACK[op]})"
                continue
            native = [p for p, (n, _s) in paths.items() if n]
            fallback = [p for p, (n, _s) in paths.items() if not n]
            syncing = [p for p, (_n, s) in paths.items() if s]

            def fb_text(items, op=op, syncing=syncing):
                out = []
                for p in items:
                    if p == "reference":
                        out.append(_STATIC_FALLBACK.get(op, "reference op on CUDA tensors"))
                    else:
                        out.append(p + ("; syncs: " + SYNCING_REFERENCE[op] if p in syncing
                                        and op in SYNCING_REFERENCE else ""))
                return "; ".join(out)

            if native and fallback:
                report[op] = f"native ({'; '.join(native)}; fallback for {fb_text(fallback)})"
            elif native:
                report[op] = f"native ({'; '.join(native)})"
            else:
                report[op] = f"fallback ({fb_text(fallback)})"
        return report


def absorb_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul ``out[t, h] = x[t, h] @ w[h]`` (x [T, H, K], w [H, K, N] -> [T, H, N]): the reference's
    ``einsum("thn,hnl->thl")`` (W_UK; W_UV with ``w`` transposed). For one token as a direct cuBLAS batched GEMM
    over the heads: the strided q_nope view and the transposed W_UV feed it without a copy, and its [H, 1, N]
    result is already [1, H, N] in memory (einsum copied q_nope first: one more launch a layer at batch 1)."""
    if x.shape[0] == 1:
        return torch.bmm(x.transpose(0, 1), w).view(1, x.shape[1], w.shape[2])
    return torch.einsum("thn,hnl->thl", x, w)


@contextlib.contextmanager
def known_syncing_fallback():
    """Run a reported, knowingly syncing reference fallback (e.g. prefill attention on toy dims) with torch's sync
    debug mode lowered from "error" to "warn": the op report already names it; the guard stays armed for the
    rest of the launch path. (The mode is "error" when every op seen so far was sync-free, e.g. right after
    capturing decode graphs at start-up, before the first prefill.)"""
    previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if previous == 2:
        torch.cuda.set_sync_debug_mode(1)
    try:
        yield
    finally:
        if previous == 2:
            torch.cuda.set_sync_debug_mode(previous)


def write_kv_cache_sync_free(kv_cache: torch.Tensor, latents: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``flat[slot] = latents`` for ``slot >= 0`` without a data-dependent shape: padding rows (negative
    slots) are sent to slot 0 carrying slot 0's current value (block 0 is reserved: never a sequence's)."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slot_mapping >= 0
    idx = torch.where(valid, slot_mapping, torch.zeros_like(slot_mapping))
    vals = torch.where(valid.unsqueeze(-1), latents.to(kv_cache.dtype), flat[0].unsqueeze(0))
    flat.index_copy_(0, idx, vals)
