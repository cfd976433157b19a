"""TileLang kernels for Ascend (950 first): the small device ops with no torch_npu fused equivalent.

One file per kernel, same shape as kernels_cuda/: a factory building the TileLang program, a torch reference
(the contract of backends/cpu where one exists), ``ci_lower()`` (lowers every program to AscendC source with
``tilelang.lower(..., target="ascend")`` — no CANN needed) and ``check()`` (the same program compiled for the
host C target and compared with the reference on random inputs). None has been compiled by bisheng or run on
an NPU yet.
"""
