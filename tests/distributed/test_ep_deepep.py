"""The CUDA kernel set's DeepEP path (``backends/cuda/ep_deepep.py``) across real processes (gloo on 127.0.0.1),
with DeepEP's normal-mode contract emulated in torch (``deep_ep_emulation.py``; no GPU here): against the reference
variable-split path, the same rows per slot in the same order and, for the same expert outputs, the combined output
within one bf16 rounding of each rank's partial sum (rtol 2^-7, atol 1e-2 of the largest output); which steps take
it (undeclared steps in bf16 with the router weights; decode steps keep the fixed capacity); a DeepSeek MoE layer
through ``ep_moe_forward``; and what ``--list-ops`` says with and without DeepEP."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from tests.distributed.rank_exit import leave_rank

D = 64
SLOTS_PER_RANK = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expert(rows: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
    """An expert output that depends only on the row and its slot: rows * (slot + 1) + slot."""
    slot = torch.repeat_interleave(torch.arange(tokens_per_slot.shape[0]), tokens_per_slot)
    return (rows.float() * (slot + 1).unsqueeze(1) + slot.unsqueeze(1)).to(rows.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = max(want.float().abs().max().item(), 1.0) if want.numel() else 1.0
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2**-7, atol=1e-2 * scale)


def _cases(world: int, rank: int):
    """(name, hidden bf16 [T, D], slots [T, k], weights [T, k]) for this rank."""
    g = torch.Generator().manual_seed(17 + rank)
    n_slots = SLOTS_PER_RANK * world
    out = []
    for name, tokens, k in (("random", 5 + 3 * rank, 3), ("top1", 4, 1), ("empty-rank", 0 if rank == 1 else 6, 2)):
        slots = torch.randint(0, n_slots, (tokens, k), generator=g)
        out.append((name, torch.randn(tokens, D, generator=g).bfloat16(), slots, torch.rand(tokens, k, generator=g)))
    # every choice on the last rank (the others receive nothing), duplicates inside a token
    slots = torch.full((3, 2), n_slots - 1)
    out.append(("all-remote", torch.randn(3, D, generator=g).bfloat16(), slots, torch.rand(3, 2, generator=g)))
    return out


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    from tests.distributed import deep_ep_emulation

    deep_ep_emulation.install()
    from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
    from deepinfer_npu.backends.cuda.ep_deepep import DeepEPState
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.distributed.ep_decode_path import agreed_ep_tokens
    from deepinfer_npu.distributed.ep_fixed_capacity import FixedCapacityHandle

    torch.set_num_threads(1)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=world, local_rank=rank, master_port=port,
                                                   timeout_s=60))
    group = groups.device_group
    try:
        placement = ExpertPlacement.contiguous(SLOTS_PER_RANK * world, world)
        ks, ref = CudaKernelSet(), CpuKernelSet()
        res: dict = {"cases": {}}
        for name, hidden, slots, weights in _cases(world, rank):
            d = ks.ep_dispatch(hidden, slots, placement, group, weights)
            rd = ref.ep_dispatch(hidden, slots, placement, group)
            got = ks.ep_combine(_expert(d.rows, d.tokens_per_slot), d, weights, group)
            want = ref.ep_combine(_expert(rd.rows, rd.tokens_per_slot), rd, weights, group)
            res["cases"][name] = dict(deep_ep=isinstance(d.state, DeepEPState),
                                      counts=torch.equal(d.tokens_per_slot, rd.tokens_per_slot),
                                      rows=torch.equal(d.rows, rd.rows), out=_close(got, want),
                                      out_dtype=got.dtype, tokens=(got.shape[0], hidden.shape[0]))
        hidden, slots, weights = _cases(world, rank)[0][1:]
        paths = {}
        with agreed_ep_tokens(16):
            d = ks.ep_dispatch(hidden, slots, placement, group, weights)
            ks.ep_combine(d.rows, d, weights, group)
            paths["decode"] = type(d.state).__name__ if not isinstance(d.state, FixedCapacityHandle) else "fixed"
        d = ks.ep_dispatch(hidden, slots, placement, group)  # no router weights: the variable splits
        ks.ep_combine(d.rows, d, weights, group)
        paths["no-weights"] = "deep_ep" if isinstance(d.state, DeepEPState) else "variable"
        d = ks.ep_dispatch(hidden.float(), slots, placement, group, weights)
        ks.ep_combine(d.rows, d, weights, group)
        paths["fp32"] = "deep_ep" if isinstance(d.state, DeepEPState) else "variable"
        res["paths"] = paths
        res["moe_layer"] = _moe_layer(world, rank, group)
        res["buffers"] = deep_ep_emulation.Buffer.created
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_process_groups()
    leave_rank()


def _moe_layer(world: int, rank: int, group) -> bool:
    """A DeepSeek-V3-style MoE layer (bf16) through ep_moe_forward on the CUDA kernel set (CPU tensors, DeepEP
    emulated) against the reference kernel set on the same weights and tokens."""
    from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.distributed.ep_moe import EPGroup, ep_moe_forward, shard_experts
    from deepinfer_npu.model_executor.layers.moe import DeepseekMoE
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

    cfg = DeepseekModelConfig.from_dict(dict(
        model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, hidden_size=32, moe_intermediate_size=16,
        intermediate_size=64, n_routed_experts=4 * world, num_experts_per_tok=3, num_hidden_layers=2,
        num_attention_heads=2, vocab_size=64, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, q_lora_rank=None, first_k_dense_replace=1))
    hidden = torch.randn(3 + 2 * rank, 32, generator=torch.Generator().manual_seed(rank)).bfloat16()
    outs = []
    for kernels in (CpuKernelSet(), CudaKernelSet()):
        torch.manual_seed(0)
        moe = DeepseekMoE(cfg, kernels, dtype=torch.bfloat16, device="cpu")
        for p in moe.parameters():
            p.data.normal_(0, 0.2)
        ep = EPGroup(ExpertPlacement.contiguous(4 * world, world), rank, group)
        shard_experts(moe, ep)
        outs.append(ep_moe_forward(moe, hidden, ep))
    return _close(outs[1], outs[0])


@pytest.mark.parametrize("world", [2, 4])
def test_deep_ep_path_against_the_reference(world, tmp_path):
    mp.start_processes(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name, case in res["cases"].items():
            assert case["deep_ep"], (rank, name)
            assert case["counts"] and case["rows"], (rank, name, case)
            assert case["out"] and case["out_dtype"] == torch.bfloat16, (rank, name, case)
            assert case["tokens"][0] == case["tokens"][1]
        assert res["paths"] == {"decode": "fixed", "no-weights": "variable", "fp32": "variable"}, res["paths"]
        assert res["buffers"] == 2  # one a kernel set and (group, slots, row bytes): reused across the cases
        assert res["moe_layer"], rank


def test_reason_names_why_not(monkeypatch):
    import sys

    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from tests.distributed import deep_ep_emulation

    placement = ExpertPlacement.contiguous(12, 3)
    hidden, slots, weights = torch.zeros(2, D).bfloat16(), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep fails
    assert "not installed" in CudaKernelSet().deep_ep_reason(hidden, slots, placement, None, weights)
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep_emulation.install())
    group = type("G", (), {"size": lambda self: 3})()
    assert "EP world size 3" in CudaKernelSet().deep_ep_reason(hidden, slots, placement, group, weights)
    group4 = type("G", (), {"size": lambda self: 4})()
    assert CudaKernelSet().deep_ep_reason(hidden, slots, placement, group4, weights) is None
    assert "router weights" in CudaKernelSet().deep_ep_reason(hidden, slots, placement, group4, None)
    assert "bf16" in CudaKernelSet().deep_ep_reason(hidden.float(), slots, placement, group4, weights)


def test_list_ops_names_deep_ep(monkeypatch):
    import sys
    from types import SimpleNamespace

    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.distributed.ep_report import ep_dispatch_report
    from tests.distributed import deep_ep_emulation

    backend = SimpleNamespace(name="cuda", dist_backend="nccl", kernels=CudaKernelSet())
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    assert "DeepEP not used: deep_ep is not installed" in ep_dispatch_report(backend)["ep_dispatch"]
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep_emulation.install())
    text = ep_dispatch_report(backend)["ep_dispatch"]
    assert "DeepEP's normal kernels (version emulated) for prefill and undeclared steps" in text, text
