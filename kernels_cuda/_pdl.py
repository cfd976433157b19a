"""Programmatic dependent launch (PDL) for the engine's TileLang kernels (sm_90 and later).

A kernel built with PDL starts with ``griddepcontrol.wait`` (``T.pdl_sync``: wait until the previous kernel of
its stream has finished and its writes are visible) and then ``griddepcontrol.launch_dependents``
(``T.pdl_trigger``: the next kernel may launch). TileLang marks such a kernel and its runtime launches it with
programmatic stream serialization (``cuLaunchKernelEx``; CUDA graphs capture it as a programmatic edge), so its
CTAs are placed on the SMs while the previous kernel still runs and the launch gap between two dependent kernels
is hidden. At batch 1 a V2-Lite decode step is ~650 kernels of 1-25 us, so that gap is a large share of a step.

Why it is safe: before its wait a kernel only loads weights (skinny_gemm's first vectors, mla_absorb's whole
slice), which no kernel writes; every other global access comes after it, so reads see everything the previous
kernels wrote, and writes cannot race a previous kernel's reads. The trigger comes after
the wait, so at most one kernel waits ahead of the one running. Kernels not built with PDL (torch, cuBLAS) are
launched as usual and wait for the full completion of what precedes them; a PDL kernel after one of them waits
for its completion too (a kernel without a trigger triggers when it exits).

On by default since session 7 (``DEEPINFER_PDL=0`` turns it off; the kernels' code is otherwise the same). Measured
on one H200, ``bench_decode_e2e.py --graphs --no-hf`` (V2-Lite shape, each window 32 decode tokens a request), tok/s:

- Session 7 (decode_inputs and moe_route on; run medians): batch 1 411.3 / 408.6 with PDL against 397.5 / 394.9
  without (two A/B pairs of 7 windows in one call; PDL windows 390.6-411.9), batch 16 1936.9 against 1911.3 and
  batch 64 6228.5 against 6131.5 (5 windows each).
- Session 6 (before decode_inputs; ~45 more host launches a step): at batch 1 PDL was bimodal, a window ran at
  380.0-399.6 (31 of 47) or at 284.7-337.1 (14), with whole runs in one mode; PDL off stayed at 373.4-382.0.
  Batch 16 / 64 +1.4-1.7 % / +1.6-2.4 %.

Why the slow mode went away is inferred, not proven: with PDL the device finishes a batch-1 step sooner, so the
host's work per step (launches, sampling inputs, post-processing: 0.95-2.42 ms over session 7's batch-1 windows,
varying from run to run) bounds the loop more often. In session 7 the PDL windows whose host waited on the device
for under 4 % of the window (``host_wait_frac_windows``) ran at 380.9-399.9 tok/s (call 1, before the host-side
savings below) and 390.6-391.2 (call 2); those with 7.3-43.2 % at 408.6-411.9 (call 2). Session 7 also
cut the host's per-step work (decode_inputs: one launch for ~45; the decode sampling inputs reused while the batch
is the same, ``Worker._decode_sampling_inputs``).
"""

import os

ENV = "DEEPINFER_PDL"


def pdl_enabled() -> bool:
    """Whether kernels built now wait / trigger programmatically (``DEEPINFER_PDL``, default on)."""
    v = os.environ.get(ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: expected 0 or 1")
    return v == "1"
