"""Shared by the kernel files' ``--bench``: median time of a launch, replayed from a CUDA graph where it can be
captured (20 launches per graph, so the per-launch figure excludes launch overhead), else timed with events.
Not a kernel file of its own (no ``ci_compile``)."""

import torch


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
