"""A DeepSeek MoE layer (V2 softmax/group-limited and V3 sigmoid/noaux_tc gating, shared experts) run
expert-parallel over 2 spawned gloo ranks equals the same layer on one process, token for token (fp32; rtol 1e-6
for the expert GEMMs' summation order over different row counts)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.distributed.ep_moe import EPGroup, ep_moe_forward, shard_experts
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from deepinfer_npu.model_executor.layers.moe import DeepseekMoE
from deepinfer_npu.model_executor.model_config import DeepseekModelConfig
from tests.distributed.rank_exit import leave_rank

CONFIGS = {
    "v2": dict(model_type="deepseek_v2", scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
               topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=0),
    "v3": dict(model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
               norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1),
}


def _layer(kind: str) -> DeepseekMoE:
    cfg = DeepseekModelConfig.from_dict(dict(
        hidden_size=32, moe_intermediate_size=16, intermediate_size=64, n_routed_experts=8, num_experts_per_tok=3,
        num_hidden_layers=2, num_attention_heads=2, vocab_size=64, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=None, first_k_dense_replace=1, **CONFIGS[kind]))
    torch.manual_seed(0)
    moe = DeepseekMoE(cfg, CpuKernelSet(), dtype=torch.float32, device="cpu")
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    return moe


def _rank_main(rank, world, port, kind, out_dir):
    torch.set_num_threads(1)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=world, local_rank=rank, master_port=port,
                                                   timeout_s=60))
    try:
        moe = _layer(kind)
        hidden = torch.randn([4, 0, 6, 1][rank], 32, generator=torch.Generator().manual_seed(rank))
        want = moe(hidden)
        ep = EPGroup(ExpertPlacement.contiguous(8, world), rank, groups.device_group)
        shard_experts(moe, ep)
        assert moe.experts.w13.shape[0] == 8 // world
        got = ep_moe_forward(moe, hidden, ep)
        torch.save({"got": got, "want": want}, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_process_groups()
    leave_rank()


@pytest.mark.parametrize("kind,world", [("v2", 2), ("v3", 2)])  # 4 ranks: test_ep_engine's V3 checkpoint
def test_ep_layer_equals_single_process(kind, world, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(world, port, kind, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(res["got"], res["want"], rtol=1e-6, atol=1e-6)
