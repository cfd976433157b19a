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

On by default since session 6 (``DEEPINFER_PDL=0`` turns it off; the kernels' code is otherwise the same).
Measured on one H200, ``bench_decode_e2e.py --graphs --no-hf --repeat 5`` (V2-Lite shape, median of five
windows, one call, session 6): PDL off 380.9 / 1894.8 / 6030.7 tok/s at batch 1 / 16 / 64; PDL on 375.6 /
1922.0 / 6172.4; PDL on with the branches of ``run_parallel`` in order 399.2 / 1837.2 / 6045.4. So the engine
runs PDL with the branches in order at one token row and on two streams above (``CudaKernelSet.run_parallel``).
Session 5 (single windows): batch 1 292.8 / 308.1 with PDL against 347.4 / 348.3 without, batch 16 +1.4 %, 64 +0.9 %.
"""

import os

ENV = "DEEPINFER_PDL"


def pdl_enabled() -> bool:
    """Whether kernels built now wait / trigger programmatically (``DEEPINFER_PDL``, default on)."""
    v = os.environ.get(ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: expected 0 or 1")
    return v == "1"
