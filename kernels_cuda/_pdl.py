"""Programmatic dependent launch (PDL) for the engine's TileLang kernels (sm_90 and later).

A kernel built with PDL starts with ``griddepcontrol.wait`` (``T.pdl_sync``: wait until the previous kernel of
its stream has finished and its writes are visible) and then ``griddepcontrol.launch_dependents``
(``T.pdl_trigger``: the next kernel may launch). TileLang marks such a kernel and its runtime launches it with
programmatic stream serialization (``cuLaunchKernelEx``; CUDA graphs capture it as a programmatic edge), so its
CTAs are placed on the SMs while the previous kernel still runs and the launch gap between two dependent kernels
is hidden. At batch 1 a V2-Lite decode step is ~650 kernels of 1-25 us, so that gap is a large share of a step.

Why it is safe: nothing a kernel does before its wait touches global memory, so reads after it see everything
the previous kernels wrote, and writes after it cannot race a previous kernel's reads. The trigger comes after
the wait, so at most one kernel waits ahead of the one running. Kernels not built with PDL (torch, cuBLAS) are
launched as usual and wait for the full completion of what precedes them; a PDL kernel after one of them waits
for its completion too (a kernel without a trigger triggers when it exits).

Off by default (``DEEPINFER_PDL=1`` turns it on; the kernels' code is otherwise the same), because at batch 1 it
is bimodal. Measured on one H200, ``bench_decode_e2e.py --graphs --no-hf --repeat 5|9`` (V2-Lite shape, each
window 32 decode tokens a request, session 6), tok/s:

- PDL off (call 3, two runs): batch 1 windows 379.5-382.0 in 9 of 10 (the tenth 373.4); run medians batch 16
  1894.8 / 1895.6, batch 64 6030.7 / 6048.5.
- PDL on: run medians batch 16 1922.0-1926.5 and batch 64 6145.9-6173.5 in five runs over three calls
  (+1.4-1.7 % / +1.6-2.4 %).
  At batch 1 (with ``run_parallel``'s branches in order, ``CudaKernelSet.parallel_branches``) a window runs either
  at 380.0-399.6 (31 of 47 windows) or at 284.7-337.1 (14; two in between), with whole runs in one mode (9 of 9 fast;
  5 of 5 slow) and runs that switch. Why is not known (not profiled: the profiler's spans include the waits).
  With PDL and two streams at batch 1 too (call 3, before that rule): median 375.6 (one window at 275.1).
- Session 5 (single windows): batch 1 292.8 / 308.1 with PDL against 347.4 / 348.3 without, batch 16 +1.4 %,
  batch 64 +0.9 %.
"""

import os

ENV = "DEEPINFER_PDL"


def pdl_enabled() -> bool:
    """Whether kernels built now wait / trigger programmatically (``DEEPINFER_PDL``, default off)."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: expected 0 or 1")
    return v == "1"
