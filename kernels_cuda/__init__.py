"""TileLang kernels for the CUDA backend (Hopper, sm_90a), imported as ``deepinfer_npu.kernels_cuda.<name>``.

One file per kernel: its factory, launch function(s), applicability checks (``reason`` / ``supported``) and
``precompile`` / ``get_kernel`` / ``ci_compile`` entry points. Importing needs no tilelang; building or launching
a kernel does (``tilelang==0.1.15``). Checks: ``tests/kernels_cuda``; timings: ``python -m
deepinfer_npu.kernels_cuda.bench NAME``.

Every kernel of the engine's decode chain waits for its predecessor with programmatic dependent launch
(``_pdl.py``; ``DEEPINFER_PDL_OFF`` names kernels built without it). TileLang's warp-specialised TMA pipelines come
out of a CUDA post-processing hook that lets only the elected producer thread wait for a free stage
(``_producer_wait.py``).
"""
