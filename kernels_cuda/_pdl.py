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

Off by default (``DEEPINFER_PDL=1`` turns it on; the kernels' code is otherwise the same). Measured on one H200
(session 5, ``bench_decode_e2e.py --graphs --no-hf``, V2-Lite shape, two runs each way in one call): batch 16
1934.8 / 1935.2 tok/s with PDL against 1908.2 / 1908.9 without, batch 64 6203.4 / 6231.5 against 6156.9 / 6142.7,
but batch 1 292.8 / 308.1 against 347.4 / 348.3 (and 333.6 / 375.3 in two other calls): at batch 1 the waiting
CTAs of the next kernel seem to take the SM slots the second stream's branch (``run_parallel``) needs; that is a
guess, not measured.
"""

import os

ENV = "DEEPINFER_PDL"


def pdl_enabled() -> bool:
    """Whether kernels built now wait / trigger programmatically (``DEEPINFER_PDL``, default off)."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: expected 0 or 1")
    return v == "1"
