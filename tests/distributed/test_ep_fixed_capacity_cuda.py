"""The fixed-capacity expert-parallel path on NCCL (two GPUs, one rank each): bit-equal to the variable-split
reference in fp32 and bf16, no host sync under torch's CUDA sync debug mode "error" (through CudaKernelSet's
override inside a declared decode step), and capturable: a CUDA graph of dispatch -> experts -> combine replayed on
new inputs gives the eager result.

    pytest -q -m gpu tests/distributed/test_ep_fixed_capacity_cuda.py
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.distributed.ep_decode_path import agreed_ep_tokens
from deepinfer_npu.distributed.ep_fixed_capacity import FixedCapacityHandle, ep_combine_fixed, ep_dispatch_fixed
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from tests.distributed.test_ep_fixed_capacity import SLOTS_PER_RANK, _case, _expert, _free_port
from tests.distributed.rank_exit import leave_rank

pytestmark = pytest.mark.gpu
WORLD = 2


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=WORLD, local_rank=rank, master_port=port,
                                                   timeout_s=120), "nccl")
    group = groups.device_group
    placement = ExpertPlacement(SLOTS_PER_RANK * WORLD, WORLD, tuple(range(SLOTS_PER_RANK * WORLD)))
    out: dict = {"equal": {}}
    try:
        ref = CpuKernelSet()
        for seed, (dtype, k, tokens, skew) in enumerate([(torch.float32, 1, [3, 5], False),
                                                         (torch.float32, 6, [0, 7], False),
                                                         (torch.bfloat16, 6, [8, 8], True),
                                                         (torch.bfloat16, 3, [64, 1], False)]):
            hidden, slots, weights = _on(device, *_case(rank, WORLD, seed, tokens, k, skew, dtype))
            want_d = ref.ep_dispatch(hidden, slots, placement, group)
            want = ref.ep_combine(_expert(want_d.rows, want_d.tokens_per_slot), want_d, weights, group)
            rows, counts, handle = ep_dispatch_fixed(hidden, slots, placement, group, max(tokens) * k)
            got = ep_combine_fixed(_expert(rows, counts, float("nan")), handle, weights, group)
            real = int(counts.sum())
            out["equal"][f"{dtype}-k{k}-{tokens}"] = (
                torch.equal(counts, want_d.tokens_per_slot) and torch.equal(rows[:real], want_d.rows)
                and torch.equal(got, want))

        # the kernel set's override in a declared decode step, with any host sync an error
        ks = CudaKernelSet()
        tokens, k = [4, 6], 3
        hidden, slots, weights = _on(device, *_case(rank, WORLD, 50, tokens, k, False, torch.bfloat16))

        def layer():
            d = ks.ep_dispatch(hidden, slots, placement, group)
            assert isinstance(d.state, FixedCapacityHandle)
            return ks.ep_combine(d.rows * 2 + 1, d, weights, group)  # padding rows included: never read

        with agreed_ep_tokens(max(tokens)):
            eager = layer()  # also warms NCCL and the allocator up before the capture
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                layer()
                out["no_sync"] = True
            finally:
                torch.cuda.set_sync_debug_mode(0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer()
        # new inputs into the captured buffers: the replay must give the eager result on them
        fresh = _on(device, *_case(rank, WORLD, 51, tokens, k, False, torch.bfloat16))
        for static, new in zip((hidden, slots, weights), fresh):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        with agreed_ep_tokens(max(tokens)):
            again = layer()
        out["graph_replay_equals_eager"] = torch.equal(captured, again) and not torch.equal(captured, eager)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_process_groups()
    leave_rank()


def test_fixed_capacity_on_nccl_is_exact_sync_free_and_capturable(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert all(res["equal"].values()), (rank, res["equal"])
        assert res["no_sync"] and res["graph_replay_equals_eager"]
