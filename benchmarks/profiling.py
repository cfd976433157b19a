"""Device time by kernel, and host time by operator, from a ``torch.profiler`` run, shared by the benchmarks that
print where time went."""

from __future__ import annotations

import collections


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
