"""TileLang kernels for the CUDA backend (Hopper, sm_90a), imported as ``deepinfer_npu.kernels_cuda.<name>``.

One file per kernel: its factory, launch function(s), applicability checks (``reason`` / ``supported``) and
``precompile`` / ``get_kernel`` / ``ci_compile`` entry points. Importing needs no tilelang; building or launching
a kernel does (``tilelang==0.1.15``). Checks: ``tests/kernels_cuda``; timings: ``python -m
deepinfer_npu.kernels_cuda.bench NAME``.

Programmatic dependent launch (PDL, sm_90 and later): every kernel of the engine's decode chain starts with
``T.pdl_sync()`` (``griddepcontrol.wait``: the previous kernel of its stream has finished and its writes are
visible) and then ``T.pdl_trigger()`` (the next kernel may launch), so its CTAs are placed while the previous
kernel still runs and the launch gap is hidden (a V2-Lite batch-1 decode step is ~650 kernels of 1-25 us; with PDL
batch 1 ran at 411 against 397 tok/s on an H200). It is safe because before its wait a kernel only loads weights,
which no kernel writes; every other global access comes after the wait. Kernels not built with PDL (torch,
cuBLAS) wait for the full completion of what precedes them, and a PDL kernel after one of them waits for it too.
"""
