"""Fork copy-on-write in the Ascend backend's split k_nope / k_rope cache layout (no torch_npu needed)."""

from __future__ import annotations

import torch
from deepinfer_npu.backends.ascend import kv_layout
from deepinfer_npu.backends.ascend.kernels import AscendKernelSet
from deepinfer_npu.backends.cpu import cache_ops
from deepinfer_npu.backends.cpu.kernels import CpuKernelSet

L, R, NB, BS = 8, 4, 6, 4


def _caches(seed: int):
    g = torch.Generator().manual_seed(seed)
    hal = torch.randn(NB, BS, L + R, generator=g)
    return hal, kv_layout.from_hal_layout(hal, L, R)


def test_split_layout_round_trip():
    hal, split = _caches(0)
    assert torch.equal(kv_layout.to_hal_layout(split, L, R), hal)
    assert not torch.equal(split, hal)  # the storage really is laid out differently


def test_ascend_copy_kv_blocks_matches_reference_on_split_layout():
    src = torch.tensor([1, 3, 2], dtype=torch.int64)
    dst = torch.tensor([4, 2, 5], dtype=torch.int64)  # block 2 is both a source and a destination
    hal_a, split_a = _caches(1)
    hal_b, _ = _caches(2)
    plain_b = hal_b.clone()  # a cache in the HAL layout (e.g. never written by the native prolog)
    ks = AscendKernelSet()
    ks.register_split_cache(split_a, L, R)
    ks.copy_kv_blocks([split_a, plain_b], src, dst)
    cache_ops.copy_kv_blocks([hal_a, hal_b], src, dst)  # the reference, on the HAL layout
    assert torch.equal(kv_layout.to_hal_layout(split_a, L, R), hal_a)
    assert torch.equal(plain_b, hal_b)
    assert torch.equal(hal_a[2], _caches(1)[0][3])  # sources were read before destinations were written

    # Negative control: the reference's dim-0 copy on the split storage corrupts it.
    _, wrong = _caches(1)
    cache_ops.copy_kv_blocks([wrong], src, dst)
    assert not torch.equal(kv_layout.to_hal_layout(wrong, L, R), hal_a)


def test_copy_kv_blocks_is_a_kernel_set_op():
    from deepinfer_npu.hal.kernel_set import KernelSet

    assert "copy_kv_blocks" in KernelSet.OPS
    assert CpuKernelSet().op_report()["copy_kv_blocks"] == "native"
    assert AscendKernelSet.copy_kv_blocks is not KernelSet.copy_kv_blocks
    hal, _ = _caches(3)
    ref = hal.clone()
    CpuKernelSet().copy_kv_blocks([hal], torch.tensor([1]), torch.tensor([0]))
    ref[0] = ref[1]
    assert torch.equal(hal, ref)
