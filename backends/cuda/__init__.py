"""CUDA backend (NVIDIA Hopper): TileLang kernels from ``kernels_cuda/`` where the shapes fit, sync-free torch
rewrites of the reference ops where that was cheap, and the CPU reference ops running on CUDA tensors for the rest.

Nothing here imports ``tilelang`` or initialises CUDA at module import time: each op's kernels are chosen once per
engine (``ops/``), imported and compiled at start-up or at their first use, and availability is probed only through
``torch.cuda.is_available()``.
"""
