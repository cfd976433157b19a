"""TileLang-Ascend kernels (``kernels_ascend/``) for the HAL ops with no torch_npu fused equivalent, decided once.

Which kernels serve which op: ``zos_fixup`` <- ``zos_seqlens_k`` (the accepted-count correction) and
``zos_scores`` + ``zos_select`` (the varlen re-split, only with ``draft_probs``; Ascend never re-splits, see
``AscendBackend.supports_device_resplit``); ``spec_verify`` <- ``spec_verify_greedy`` (all-greedy batches) and
``rejection_accept`` (the acceptance scan of batches with sampled rows; greedy rows enter it as ``u = 0``,
``p = [draft == argmax]``), with the argmax, the acceptance uniforms and the bonus / residual Gumbel draws from
``sample_pieces`` (``greedy_argmax``, ``gumbel_argmax``: the hash RNG of deepinfer_npu/sampling/rng.py +
temperature + Gumbel-max race, ``argmax_combine``); ``moe_gating_topk`` <- ``gating_topk`` only for configurations
outside ``npu_moe_gating_top_k``'s documented limits (the fused op serves the rest; :func:`gating_decision`).

:func:`probe` decides once, at start-up (``AscendBackend.__init__``), whether the kernels can be used: tilelang
importable **and** its Ascend JIT path present (the ``bisheng`` compiler and CCE ``ld.lld`` from CANN, found the way
``tilelang.contrib.bisheng`` looks for them, and tilelang's torch_npu stream bridge ``tilelang_ascend_npu_exchange``,
built only with ``USE_ASCEND=ON``) **and** an NPU present (not the CPU contract emulation). Otherwise the ops run
the torch composition (the reference ops on the NPU) and ``op_report`` says why. Cheap checks come first: tilelang
(~2 s to import) is imported only when everything else is there.

:class:`TileLangAscendKernels` holds the compositions around the compiled kernels. **Never run on an NPU**: with
``target="ascend"`` each program is compiled by ``tilelang.compile(..., target="ascend")`` (bisheng) at first use;
tests build the *same programs* for the host C target (``target="c"``) and check these compositions against the
reference ops on the CPU — that verifies the wiring and the algorithms, not the AscendC build or the hardware.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from . import runtime

#: HAL op -> the kernels_ascend programs it runs when the TileLang path is usable.
WIRED = {
    "zos_fixup": "kernels_ascend.zos_seqlens_k (+ zos_scores/zos_select for a varlen re-split)",
    "spec_verify": "kernels_ascend.spec_verify_greedy (all-greedy batches) / rejection_accept (sampled rows) + "
    "sample_pieces (argmax, acceptance uniforms, bonus / residual Gumbel draws)",
}
#: The kernel for gating configurations npu_moe_gating_top_k does not take (decided per model shape).
GATING = "kernels_ascend.gating_topk"


@dataclass(frozen=True)
class Probe:
    usable: bool
    reason: str  # what is missing (or what was found)


def _find_bisheng() -> str | None:
    """Where ``tilelang.contrib.bisheng.find_bisheng_path`` would find bisheng: ``$BISHENG_HOME/bin``, then PATH."""
    home = os.environ.get("BISHENG_HOME", "")
    if home and os.path.isfile(os.path.join(home, "bin", "bisheng")):
        return os.path.join(home, "bin", "bisheng")
    return shutil.which("bisheng")


def _find_ld_lld(bisheng: str | None) -> str | None:
    """As ``tilelang.contrib.bisheng.find_ld_lld_path``: the CANN toolkit's CCE-capable ld.lld."""
    for env in ("BISHENG_HOME", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        root = os.environ.get(env)
        for cand in ((os.path.join(root, "bin", "ld.lld"), os.path.join(root, "ld.lld")) if root else ()):
            if os.path.isfile(cand):
                return cand
    if bisheng and os.path.isfile(os.path.join(os.path.dirname(bisheng), "ld.lld")):
        return os.path.join(os.path.dirname(bisheng), "ld.lld")
    return shutil.which("ld.lld")


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def probe() -> Probe:
    """Can the TileLang-Ascend kernels run here? Decided once per process by the backend (see module docstring)."""
    missing = []
    npu_missing = runtime.unavailable_reason()  # never imports torch_npu when it is not installed
    if npu_missing is not None:
        missing.append(f"no NPU ({npu_missing})")
    elif runtime.emulated():
        missing.append("no NPU (torch_npu is the CPU contract emulation)")
    if not _spec("tilelang"):
        missing.append("tilelang is not installed (pip install tilelang==0.1.15, built with USE_ASCEND=ON)")
    bisheng = _find_bisheng()
    if bisheng is None:
        missing.append("bisheng (CANN's AscendC compiler, tilelang's Ascend JIT) not found (BISHENG_HOME unset, "
                       "not on PATH)")
    elif _find_ld_lld(bisheng) is None:
        missing.append("CANN's CCE ld.lld not found (ASCEND_HOME_PATH)")
    if not _spec("tilelang_ascend_npu_exchange"):
        missing.append("tilelang_ascend_npu_exchange missing (tilelang's torch_npu stream bridge: tilelang built "
                       "without USE_ASCEND=ON)")
    if missing:
        return Probe(False, "; ".join(missing))
    try:  # everything is there: really import tilelang and its Ascend backend
        tl = importlib.import_module("deepinfer_npu.kernels_ascend._tl")
        if tl.tilelang is None:
            return Probe(False, "tilelang failed to import")
        importlib.import_module("tilelang.ascend")
    except Exception as e:  # noqa: BLE001
        return Probe(False, f"tilelang's Ascend backend failed to import ({type(e).__name__}: {e})")
    return Probe(True, f"tilelang + bisheng ({bisheng}) + an NPU")


def gating_decision(fused_why: str, probe_result: Probe | None, target: str | None, params):
    """HAL ``moe_gating_topk`` when ``npu_moe_gating_top_k`` does not fit (``fused_why`` says why): the TileLang
    kernel if the start-up probe allowed the kernels (``target`` = the built kernels' target, None when not) and the
    kernel takes the configuration, else the reference composition. Returns ``(native, use_kernel, detail)``."""
    if target is None:
        why = probe_result.reason if probe_result is not None else "not probed"
        return False, False, (f"{fused_why}; TileLang-Ascend {GATING} not usable here: {why}; the reference "
                              "composition runs on the device")
    from deepinfer_npu.kernels_ascend.gating_topk import unsupported

    bad = unsupported(params.num_experts, params.top_k, params.scoring_func, params.topk_method, params.n_group,
                      params.topk_group)
    if bad is not None:
        return False, False, f"{fused_why}; {GATING} does not take it ({bad}); the reference composition runs"
    where = "host C build: tests only" if target == "c" else "never run on an NPU"
    return True, True, f"TileLang-Ascend {GATING} ({fused_why}) ({where})"


class TileLangAscendKernels:
    """The wired HAL ops on compiled kernels_ascend programs (built lazily per configuration and cached).

    NOT RUN ON AN NPU: ``target="ascend"`` compiles with bisheng at first use and has never executed; tests use
    ``target="c"`` (same programs, host C build) to check these compositions against the reference ops.
    """

    def __init__(self, target: str = "ascend") -> None:
        if target not in ("ascend", "c"):
            raise ValueError(f"target must be 'ascend' or 'c', got {target!r}")
        self.target = target
        self._compiled: dict[tuple, Any] = {}
        self.calls: dict[str, int] = {}

    def _kernel(self, module: str, builder: str, *params):
        key = (module, builder, *params)
        if key not in self._compiled:
            tl = importlib.import_module("deepinfer_npu.kernels_ascend._tl")
            mod = importlib.import_module(f"deepinfer_npu.kernels_ascend.{module}")
            prog = getattr(mod, builder)(*params)
            if self.target == "c":
                self._compiled[key] = tl.compile_c(prog)
            else:  # NPU only, never executed yet: AscendC via bisheng (tilelang/ascend/README.md)
                self._compiled[key] = tl.tilelang.compile(prog, target="ascend")
        self.calls[module] = self.calls.get(module, 0) + 1
        self.calls[f"{module}.{builder}"] = self.calls.get(f"{module}.{builder}", 0) + 1
        return self._compiled[key]

    # ---- sampling pieces --------------------------------------------------------------------------------------
    def _finish_argmax(self, part_val, part_idx, splits: int) -> torch.Tensor:
        ids = torch.empty(part_val.shape[0], dtype=torch.int32, device=part_val.device)
        self._kernel("sample_pieces", "build_combine", splits)(part_val, part_idx, ids)
        return ids.to(torch.int64)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` (fp32 [B, V], B > 0): first maximum, NaN above all, as torch's."""
        from deepinfer_npu.kernels_ascend.sample_pieces import SPLITS

        b = logits.shape[0]
        pv = torch.empty(b, SPLITS, dtype=torch.float32, device=logits.device)
        pi = torch.empty(b, SPLITS, dtype=torch.int32, device=logits.device)
        self._kernel("sample_pieces", "build_greedy_argmax", SPLITS)(logits.float().contiguous(), pv, pi)
        return self._finish_argmax(pv, pi, SPLITS)

    def gumbel_argmax(self, logits, temperature, seeds, offsets, stream: int) -> torch.Tensor:
        """``argmax(logits / temperature + g)``, ``g = -log(-log(U(seed, offset, v, stream)))`` per row (B > 0)."""
        from deepinfer_npu.kernels_ascend.sample_pieces import SPLITS

        b = logits.shape[0]
        pv = torch.empty(b, SPLITS, dtype=torch.float32, device=logits.device)
        pi = torch.empty(b, SPLITS, dtype=torch.int32, device=logits.device)
        self._kernel("sample_pieces", "build_gumbel_argmax", stream, SPLITS)(
            logits.float().contiguous(), temperature.float().contiguous(), seeds.to(torch.int64).contiguous(),
            offsets.to(torch.int64).contiguous(), pv, pi)
        return self._finish_argmax(pv, pi, SPLITS)

    def uniform0(self, seeds, offsets, stream: int) -> torch.Tensor:
        """``hash_uniform_cols(seeds, offsets, [0], stream)[:, 0]``: one uniform per row (B > 0), bit for bit."""
        u = torch.empty(seeds.shape[0], 1, dtype=torch.float32, device=seeds.device)
        self._kernel("sample_pieces", "build_hash_uniform", stream)(
            seeds.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous(), u)
        return u.squeeze(1)

    # ---- moe_gating_topk (configurations outside npu_moe_gating_top_k's limits) -----------------------------------
    def moe_gating_topk(self, router_logits: torch.Tensor, bias: torch.Tensor | None, params):
        """The HAL op (contract: backends/cpu/moe.py) on kernels_ascend.gating_topk (one block per token)."""
        has_bias = bias is not None and params.topk_method == "noaux_tc"  # the reference reads it only there
        logits = router_logits.float().contiguous()
        n, e = logits.shape
        weights = torch.empty(n, params.top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(n, params.top_k, dtype=torch.int32, device=logits.device)
        if n:
            kernel = self._kernel("gating_topk", "build", params.num_experts, params.top_k, params.scoring_func,
                                  params.topk_method, params.n_group, params.topk_group, bool(params.norm_topk_prob),
                                  float(params.routed_scaling_factor), has_bias)
            b = bias.float().contiguous() if has_bias else logits.new_zeros(e)
            kernel(logits, b, weights, ids)
        return weights, ids

    # ---- zos_fixup --------------------------------------------------------------------------------------------
    def zos_fixup(self, seqlens_q, seqlens_k, optimistic, slots, correction, draft_probs=None, caps=None):
        """The HAL op (contract: backends/cpu/zos.py) on zos_seqlens_k, then zos_scores + zos_select."""
        i32 = torch.int32
        b = seqlens_k.shape[0]
        opt, slot = optimistic.to(i32), slots.to(i32)
        sk = torch.empty(b, dtype=i32, device=seqlens_k.device)
        if b:
            self._kernel("zos_seqlens_k", "build")(seqlens_k.to(i32).contiguous(), opt, slot,
                                                   correction.to(i32).contiguous(), sk)
        sq = seqlens_q.to(i32)
        if draft_probs is None or caps is None or b == 0:
            return sq, sk
        k = draft_probs.shape[1]
        # The reference clamps the probabilities to [0, 1] and zeroes NaN products: the same on the inputs.
        probs = torch.nan_to_num(draft_probs.float().clamp(0.0, 1.0), nan=0.0).contiguous()
        score = torch.empty(b * k, dtype=torch.float32, device=sk.device)
        self._kernel("zos_seqlens_q", "build_scores", k)(probs, slot, caps.to(i32), opt, score)
        q_out, k_out = torch.empty_like(sq), torch.empty_like(sk)
        self._kernel("zos_seqlens_q", "build_select", k)(score, sq.contiguous(), sk, opt, q_out, k_out)
        return q_out, k_out

    # ---- spec_verify ------------------------------------------------------------------------------------------
    def spec_verify(self, logits, draft_next, row_of_token, j_of_token, num_rows: int, max_q: int, t,
                    ban_mask=None):
        """The HAL op (contract: backends/cpu/spec_verify.py). Softmax, the top-k / top-p mask and logprobs stay aten
        ops exactly as in the reference; the argmax, the acceptance uniforms and the bonus / residual Gumbel draws
        (sample_pieces), the per-row acceptance scan and, for all-greedy batches, the emitted tokens come from the
        kernels."""
        from deepinfer_npu.backends.cpu import spec_verify as ref
        from deepinfer_npu.backends.cpu.logits_processors import apply_post_temperature, apply_pre_temperature
        from deepinfer_npu.backends.cpu.sampling import compute_logprobs, top_k_top_p_mask

        from deepinfer_npu.sampling.rng import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE

        i32, i64 = torch.int32, torch.int64
        logits = logits.float()
        device = logits.device
        raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_num_logprobs is not None else None
        if ban_mask is not None:
            logits = logits.masked_fill(ban_mask, float("-inf"))
        if t.needs_processing:  # bias and penalties, as the reference (torch ops)
            logits = apply_pre_temperature(logits, t)
        counts = torch.zeros(num_rows, dtype=i64, device=device).index_add_(
            0, row_of_token, torch.ones_like(row_of_token))
        cu = torch.zeros(num_rows + 1, dtype=i32, device=device)
        cu[1:] = torch.cumsum(counts, 0).to(i32)
        n = draft_next.shape[0]
        greedy_tok = self.argmax(logits) if n else logits.argmax(dim=-1)
        draft = draft_next.to(i32).contiguous()
        accepted = torch.empty(num_rows, dtype=i32, device=device)
        if t.all_greedy:
            target = torch.empty(n, dtype=i32, device=device)
            emitted = torch.empty(num_rows, max_q, dtype=i32, device=device)
            if num_rows:
                self._kernel("spec_verify_greedy", "build", max_q)(greedy_tok.to(i32), draft, cu, accepted,
                                                                   target, emitted)
            target_tokens, emitted, accepted = target.to(i64), emitted.to(i64), accepted.to(i64)
        else:
            safe = draft_next.clamp(min=0)
            scaled = apply_post_temperature(logits / t.temperature[:, None], t)
            if t.need_top_k or t.need_top_p:
                keep = top_k_top_p_mask(scaled, t.top_k, t.top_p, t.need_top_k, t.need_top_p)
                scaled = scaled.masked_fill(~keep, float("-inf"))
            p_draft = torch.softmax(scaled, dim=-1).gather(1, safe[:, None]).squeeze(1)
            u = self.uniform0(t.seeds, t.offsets, STREAM_ACCEPT) if n else p_draft
            # Greedy rows through the same scan: accepted iff 0 < [draft == argmax].
            u = torch.where(t.is_greedy, torch.zeros_like(u), u).float().contiguous()
            p = torch.where(t.is_greedy, (greedy_tok == safe).float(), p_draft.float()).contiguous()
            ok = torch.empty(n, dtype=i32, device=device)
            if num_rows:
                self._kernel("rejection_accept", "build", max_q)(u, p, draft, cu, ok, accepted)
            accepted = accepted.to(i64)
            # The reference's _gumbel_argmax(scaled, ...) on the kernel: scaled / 1.0 is scaled, exactly.
            one = torch.ones_like(t.temperature, dtype=torch.float32)
            bonus, residual = greedy_tok, greedy_tok
            if n:
                bonus = torch.where(t.is_greedy, greedy_tok,
                                    self.gumbel_argmax(scaled, one, t.seeds, t.offsets, STREAM_SAMPLE))
                without = scaled.scatter(1, safe[:, None], float("-inf"))
                residual = torch.where(t.is_greedy, greedy_tok,
                                       self.gumbel_argmax(without, one, t.seeds, t.offsets, STREAM_RESIDUAL))
            acc_tok = accepted.index_select(0, row_of_token)
            at_stop = torch.where(draft_next >= 0, residual, bonus)
            target_tokens = torch.where(j_of_token < acc_tok, safe, at_stop)
            emitted = torch.full((num_rows, max_q), -1, dtype=i64, device=device)
            live = j_of_token <= acc_tok
            emitted[row_of_token, j_of_token] = torch.where(live, target_tokens, torch.full_like(target_tokens, -1))
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs(raw_logprobs, target_tokens, t.max_num_logprobs)
        return ref.VerifyOutput(emitted=emitted, num_emitted=accepted + 1, accepted=accepted,
                                target_tokens=target_tokens, logprobs=logprobs)
