"""TileLang kernels for the CUDA backend (Hopper, sm_90a).

One file per kernel: factory, torch reference, correctness check and benchmark, runnable alone
(``python kernels_cuda/<kernel>.py --check --bench``). Each module exposes ``ci_compile()`` for
tests/kernels_cuda/test_compile.py. Importing needs no tilelang; building or launching a kernel does
(``tilelang==0.1.15``). Measurements: kernels_cuda/NOTES.md.
"""
