"""Shared by the kernel files' ``--bench``: median time of a launch, replayed from a CUDA graph where it can be
captured (20 launches per graph, so the per-launch figure excludes launch overhead), else timed with events.
Not a kernel file of its own (no ``ci_compile``). Also the copy bandwidth the benchmarks compare against, and the
kernel files' guard for GPU-only flags."""

import sys

import torch

GPU_FLAGS = ("check", "bench", "check_prefill", "sweep_batch1", "diagnose")  # dests of GPU-only jobs


def exit_without_cuda(args) -> None:
    """Stop a kernel file run alone when it is asked for a GPU-only job (``GPU_FLAGS``) and there is no CUDA
    device: a message naming the flags, before any compile, instead of a CUDA error from deep inside."""
    flags = ["--" + f.replace("_", "-") for f in GPU_FLAGS if getattr(args, f, False)]
    if flags and not torch.cuda.is_available():
        sys.exit(f"{' '.join(flags)}: no CUDA device here (torch.cuda.is_available() is False); "
                 "tests/kernels_cuda/test_compile.py compiles the kernels without one")


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy GB/s counting bytes read + written (median of do_bench)."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_us(fn, graph=True):
    """-> (microseconds per call, "graph" | "events")."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            reps = 20
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(reps):
                    fn()
            return do_bench(gr.replay, warmup=25, rep=200, return_mode="median") / reps * 1e3, "graph"
        except Exception:  # noqa: BLE001 - e.g. a syncing torch op
            torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3, "events"
