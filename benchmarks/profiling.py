"""Device time by kernel, and host time by operator, from a ``torch.profiler`` run, shared by the benchmarks that
print where time went."""

from __future__ import annotations

import collections
import pstats


def kernel_events(prof, device_type: str, cpu_ops: bool = False) -> list[tuple[int, str, float]]:
    """(start, name, us) of every CUDA kernel ``prof`` recorded, in start order; off CUDA with ``cpu_ops``, every
    operator with its self CPU time instead (a CPU rehearsal), else nothing."""
    import torch

    out = []
    for ev in prof.events():
        if device_type == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        elif cpu_ops:
            us = ev.self_cpu_time_total
        else:
            continue
        out.append((ev.time_range.start, ev.name, us))
    return sorted(out)


def totals_by_name(events: list[tuple[int, str, float]]) -> list[tuple[str, float, int]]:
    """(name, total us, calls) per kernel name, the largest total first."""
    per_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for _start, name, us in events:
        per_name[name][0] += us
        per_name[name][1] += 1
    return sorted(((n, v[0], v[1]) for n, v in per_name.items()), key=lambda t: -t[1])


def host_ops(prof, top: int) -> list[tuple[str, float, int]]:
    """(name, self CPU us, calls) of the host's operators and runtime calls, the largest first: where a host-bound
    run spends its time (``aten::_local_scalar_dense`` or ``cudaStreamSynchronize`` near the top: a sync)."""
    return sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda t: -t[1])[:top]


def _short_name(fn: tuple) -> str:
    """cProfile's (file, line, function) as ``package/path.py:line(function)``, or the builtin's name."""
    path, line, name = fn
    for root in ("deepinfer_npu/", "backends/", "kernels_cuda/", "benchmarks/", "torch/", "tilelang/"):
        if root in path:
            path = root + path.rsplit(root, 1)[1]
            break
    return name if path == "~" else f"{path}:{line}({name})"


def python_functions(prof, per: int, top: int) -> dict:
    """A finished ``cProfile.Profile`` -> the top Python functions by own time and by inclusive time, as
    ``[name, us per unit, calls per unit]`` with ``per`` units (steps, requests) in the profiled window."""
    stats = pstats.Stats(prof).stats  # {fn: (primitive calls, calls, own s, inclusive s, callers)}

    def ranked(key: int) -> list:
        rows = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [[_short_name(fn)[:100], round(1e6 * v[key] / per, 1), round(v[1] / per, 1)] for fn, v in rows]

    return {"host_functions_self": ranked(2), "host_functions_cum": ranked(3)}
