"""CUDA kernel warm-up: every TileLang configuration the engine can reach, compiled at start-up.

TileLang kernels (``kernels_cuda/``) are JIT-compiled per configuration (seconds each, nvcc included) at the first
call that selects them, then cached in memory and on disk. A first call inside a served or timed step stalls it:
a DFlash benchmark on an H200 ran at 37 tok/s instead of ~480 while zos_fixup's re-split variants compiled inside
its first decode steps. ``CudaKernelSet.warmup`` therefore asks each selected op implementation
(``backends/cuda/ops/``) which configurations the engine's ``KernelWarmupPlan`` reaches and compiles them before the
first step through each module's own ``precompile`` (builds on the calling thread, nvcc in parallel threads).
Modules are compiled one after another: CPython 3.11's ``ast.parse`` is not thread-safe, so two modules must never
build (parse) their kernels at once. With TileLang's disk cache warm, a restart only re-parses (~0.1 s a config).

A module whose compile fails is turned off in the kernel set: its ops fall back to the reference with the failure
as the reason (as a failed import does), and the summary names it; start-up continues.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

from .ops.base import tilelang_importable

logger = logging.getLogger(__name__)

#: the order modules compile in: the forward's, then verification and the ZOS correction
COMPILE_ORDER = ("rms_norm", "mla_rope_cache", "mla_decode", "mla_absorb", "skinny_gemm", "silu_mul", "moe_routing",
                 "moe_gemm", "moe_gemm_swap", "fp8_quant", "fp8_gemm", "fp8_grouped_gemm", "spec_verify", "zos_fixup",
                 "decode_inputs")


def reachable_configs(kernels: Any, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
    """``{kernels_cuda module: [config, ...]}`` the kernel set's selection reaches for ``plan``, in compile order;
    modules with nothing to compile are left out."""
    configs = kernels.warmup_configs(plan, num_sms)
    order = {name: i for i, name in enumerate(COMPILE_ORDER)}
    return dict(sorted(configs.items(), key=lambda item: order.get(item[0], len(order))))


def _compile(name: str, mod, cfgs: list[tuple], plan: KernelWarmupPlan, device: torch.device) -> None:
    if name == "mla_decode":
        mod.precompile(cfgs, softmax_scale=float(plan.softmax_scale))
    elif name == "moe_gemm":
        # no precompile: its public get_kernel (one at a time), and expert_starts on an all-zero count vector,
        # which compiles the expert scan at its first launch
        for kind, cfg in cfgs:
            if kind == "gemm":
                mod.get_kernel(*cfg)
            else:
                mod.expert_starts(torch.zeros(cfg[0], dtype=torch.int64, device=device))
    else:
        mod.precompile(cfgs)


def _compiled_kernels(mod) -> list:
    """TileLang kernels held in a module's caches (dicts and lists of its globals)."""
    found = []
    for obj in list(vars(mod).values()):
        values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
        found += [v for v in list(values) if hasattr(getattr(v, "adapter", None), "get_exportable_executable")]
    return found


def _link(kernel) -> None:
    executable = kernel.adapter.get_exportable_executable()
    if hasattr(executable, "jit"):  # tvm.runtime.Executable: jit() builds and caches the runnable module
        executable.jit()


def _load_executables(mods: list) -> int:
    """Link and load each compiled kernel's host module now. TileLang builds it at a kernel's first call (a gcc run
    of the host wrapper, ~130 ms on an H200 host): seen as 0.5 s inside the first decode steps of a DFlash + varlen
    run whose kernels the warm-up had compiled but not called. Kernels loaded from TileLang's disk cache have it."""
    kernels = [k for m in mods for k in _compiled_kernels(m)]
    with cf.ThreadPoolExecutor(max(1, min(16, len(kernels)))) as ex:
        list(ex.map(_link, kernels))
    return len(kernels)


def _counts(configs: dict[str, list[tuple]]) -> str:
    if not configs:
        return "no TileLang kernel applies"
    parts = []
    for name, cfgs in configs.items():
        n_prefill = sum(1 for c in cfgs if name == "mla_decode" and len(c) == 4)
        parts.append(f"{name}: {len(cfgs)}" + (f" ({n_prefill} prefill)" if n_prefill else ""))
    return ", ".join(parts)


def warm_up(kernels: Any, plan: KernelWarmupPlan) -> str:
    """Compile every configuration of :func:`reachable_configs`, module by module; -> ``"N configs in X s
    (module: n, ...)"`` plus the modules that failed or were skipped. A module that fails is turned off in the
    kernel set (its ops then run the reference, with this reason)."""
    t0 = time.perf_counter()
    if not tilelang_importable():
        return "nothing to warm up: tilelang is not installed (every TileLang op runs the reference)"
    try:
        num_sms = kernels.num_sms
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            kernels.num_sms = num_sms
        configs = reachable_configs(kernels, plan, num_sms)
    except Exception as e:  # noqa: BLE001 - a bug here must not stop start-up; the kernels compile at first use
        logger.warning("kernel warm-up skipped: listing the configurations failed: %s: %s", type(e).__name__, e)
        return f"skipped: listing the configurations failed: {type(e).__name__}: {e}"
    skipped: dict[str, str] = {}
    for name in list(configs):
        if kernels.modules.get(name) is None:  # imported as the op would; the reason is kept
            skipped[name] = kernels.modules.error(name)
            del configs[name]
    total = sum(len(c) for c in configs.values())
    logger.info("kernel warm-up: compiling %d TileLang kernel configs (%s) ...", total, _counts(configs))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    failed: dict[str, str] = {}
    for i, (name, cfgs) in enumerate(configs.items(), 1):
        t1 = time.perf_counter()
        try:
            _compile(name, kernels.modules.get(name), cfgs, plan, device)
        except Exception as e:  # noqa: BLE001 - never fail start-up: the ops fall back to the reference
            why = f"warm-up compile failed: {type(e).__name__}: {str(e).strip()[:200]}"
            failed[name] = why
            kernels.modules.disable(name, f"kernels_cuda.{name} {why}")
            logger.warning("kernel warm-up: kernels_cuda.%s %s; its ops fall back to the reference", name, why)
            continue
        logger.info("kernel warm-up [%d/%d]: kernels_cuda.%s, %d configs in %.1f s", i, len(configs), name,
                    len(cfgs), time.perf_counter() - t1)
    if failed:  # the selection learns which modules are off now
        kernels.select(kernels.config)
    done = {n: c for n, c in configs.items() if n not in failed}
    try:
        loaded = _load_executables([kernels.modules.get(n) for n in done])
        logger.info("kernel warm-up: %d kernels linked and loaded", loaded)
    except Exception as e:  # noqa: BLE001 - the first call links them instead
        logger.warning("kernel warm-up: loading the compiled kernels failed (%s: %s); the first calls will",
                       type(e).__name__, e)
    summary = f"{sum(len(c) for c in done.values())} configs in {time.perf_counter() - t0:.1f} s ({_counts(done)})"
    if failed:
        summary += "; failed: " + ", ".join(f"{n} ({why})" for n, why in failed.items())
    if skipped:
        summary += "; skipped: " + ", ".join(f"{n} ({why})" for n, why in skipped.items())
    logger.info("kernel warm-up: %s", summary)
    return summary
