"""MC2 expert-parallel dispatch / combine (``npu_moe_distribute_dispatch`` / ``_combine``) under the contract
emulation, in real processes (spawn, gloo on 127.0.0.1).

The Ascend kernel set's ``ep_dispatch`` / ``ep_combine`` on MC2 must give what the reference all-to-all gives, bit
for bit: the same rows and counts per local slot and the same fp32-weighted combine, and the single-process MoE's
output. World 4 runs with the emulated SoC's world-size set relaxed (named in each test); world 8 runs once under
A3's real limits (H 7168, bf16, K 8). Contract violations are checked in-process (the checks precede any
communication). What this proves: our calls fit the documented contract and the documented semantics give the
reference's result. Not the chip's kernels, HCCL, or speed.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.backends.ascend import capabilities as caps
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from parity_tests.npu_emulation import CALLS, ContractError, emulated_npu, ops_ep
from tests.distributed.rank_exit import leave_rank

# world-size set lifted (the op and the kernel set's decision alike); every other A3 limit as documented, H and
# dtype as the emulation profile lifts them for every op
RELAXED_SOC = dataclasses.replace(ops_ep.A3_DIMS_LIFTED, name="A3 (any world size)", ep_world_sizes=None)
RELAXED_LIMITS = dataclasses.replace(caps.EMULATION, mc2=dataclasses.replace(caps.EMULATION.mc2, ep_world_sizes=None))
STRICT_A3_LIMITS = dataclasses.replace(caps.A2_A3, mc2=caps.MC2_A3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routing(num_tokens: int, num_slots: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct slots a token, skewed towards the low slots (a Zipf-like preference); weights fp32 [T, K]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_slots, generator=g) - 1.5 * torch.log1p(torch.arange(num_slots))
    slots = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return slots, weights


def _scale_shift(num_slots: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.rand(num_slots, generator=g) + 0.5, torch.randn(num_slots, generator=g).to(dtype).float()


def _experts(rows: torch.Tensor, counts: torch.Tensor, first_slot: int, scale, shift) -> torch.Tensor:
    """A row-wise expert (rows of slot s: x * scale[s] + shift[s] in fp32): its value for a row does not depend on
    which rows run with it, so the single-process result can be compared bit for bit."""
    n = int(counts.sum())
    slot = first_slot + torch.repeat_interleave(torch.arange(counts.numel()), counts)
    out = torch.zeros_like(rows)
    out[:n] = (rows[:n].float() * scale[slot].unsqueeze(1) + shift[slot].unsqueeze(1)).to(rows.dtype)
    return out


def _single_process(hidden, slots, weights, scale, shift) -> torch.Tensor:
    per = hidden.float().unsqueeze(1) * scale[slots].unsqueeze(-1) + shift[slots].unsqueeze(-1)
    per = per.to(hidden.dtype).float()
    return (per * weights.float().unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


def _round(kernels, rank, hidden, slots, weights, placement, group, scale, shift) -> dict:
    d = kernels.ep_dispatch(hidden, slots, placement, group)
    out = _experts(d.rows, d.tokens_per_slot, rank * placement.slots_per_rank, scale, shift)
    return {"rows": d.rows, "counts": d.tokens_per_slot, "y": kernels.ep_combine(out, d, weights, group)}


def _layer_round(limits, rank: int, world: int, group) -> dict:
    """A DeepSeek-V3 MoE layer (sigmoid noaux_tc gating, a shared expert) through ``ep_moe_forward`` on the Ascend
    kernel set: MC2 vs the reference all-to-all (no token bound) vs the whole layer on one process."""
    from deepinfer_npu.backends.ascend.kernels import AscendKernelSet
    from deepinfer_npu.distributed.ep_moe import EPGroup, ep_moe_forward, shard_experts
    from deepinfer_npu.model_executor.layers.moe import DeepseekMoE
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

    cfg = DeepseekModelConfig.from_dict(dict(
        model_type="deepseek_v3", hidden_size=32, moe_intermediate_size=16, intermediate_size=64,
        n_routed_experts=8, num_experts_per_tok=3, num_hidden_layers=2, num_attention_heads=2, vocab_size=64,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=None,
        first_k_dense_replace=1, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1))
    hidden = torch.randn([4, 1, 7, 2][rank], 32, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, bound in (("single", None), ("reference", None), ("mc2", 8)):
        kernels = AscendKernelSet(limits)
        kernels.ep_max_tokens_per_rank = bound
        torch.manual_seed(0)
        moe = DeepseekMoE(cfg, kernels, dtype=torch.float32, device="cpu")
        for p in moe.parameters():
            p.data.normal_(0, 0.2)
        if name == "single":
            out[name] = moe(hidden)
            continue
        ep = EPGroup(ExpertPlacement.contiguous(8, world), rank, group)
        shard_experts(moe, ep)
        calls = CALLS["npu_moe_distribute_dispatch"]
        out[name] = ep_moe_forward(moe, hidden, ep)
        out[f"{name}_calls"] = CALLS["npu_moe_distribute_dispatch"] - calls
    return out


def _graph_round(kernels, rank: int, placement, group, h: int, k: int) -> dict:
    """Capture dispatch + combine in an emulated NPU graph, then replay it on new tokens and routing: MC2 needs no
    host read (the reference path's split sizes would fail the capture)."""
    n = 5

    def inputs(seed):
        slots, weights = _routing(n, placement.num_slots, k, seed=seed)
        return torch.randn(n, h, generator=torch.Generator().manual_seed(seed)), slots, weights

    static_h, static_s, static_w = inputs(rank)

    def step():
        d = kernels.ep_dispatch(static_h, static_s, placement, group)
        return kernels.ep_combine(d.rows * 2, d, static_w, group)

    step()  # eager first: the decision and the MC2 group are made outside the capture
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        captured = step()
    new_h, new_s, new_w = inputs(1000 + rank)
    static_h.copy_(new_h), static_s.copy_(new_s), static_w.copy_(new_w)
    graph.replay()
    return {"replayed": captured.clone(), "eager": step(), "tasks": len(graph.tasks)}


def _rank_main(rank: int, world: int, port: int, out_dir: str, case: dict) -> None:
    from deepinfer_npu.backends.ascend.kernels import AscendKernelSet
    from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
    from deepinfer_npu.distributed.parallel_state import (DistributedConfig, destroy_process_groups,
                                                          init_process_groups)

    torch.set_num_threads(1)
    soc, limits = {"relaxed": (RELAXED_SOC, RELAXED_LIMITS), "a3": (ops_ep.A3, STRICT_A3_LIMITS)}[case["soc"]]
    with emulated_npu(), ops_ep.use_soc(soc):
        groups = init_process_groups(DistributedConfig(rank=rank, world_size=world, local_rank=rank,
                                                       master_port=port, timeout_s=60))
        try:
            group, dtype, h, k = groups.device_group, case["dtype"], case["hidden"], case["top_k"]
            placement = ExpertPlacement.contiguous(case["experts"], world)
            scale, shift = _scale_shift(placement.num_slots, dtype)
            mc2 = AscendKernelSet(limits)
            mc2.ep_max_tokens_per_rank = case["bound"]
            unbounded = AscendKernelSet(limits)  # no agreed token bound: the reference path
            results = {}
            for name, tokens in case["rounds"].items():
                hidden = torch.randn(tokens[rank], h, generator=torch.Generator().manual_seed(10 * rank + 1))
                hidden = hidden.to(dtype)
                slots, weights = _routing(tokens[rank], placement.num_slots, k, seed=100 + rank)
                calls = CALLS["npu_moe_distribute_dispatch"]
                res = {"ref": _round(CpuKernelSet(), rank, hidden, slots, weights, placement, group, scale, shift),
                       "mc2": _round(mc2, rank, hidden, slots, weights, placement, group, scale, shift),
                       "single": _single_process(hidden, slots, weights, scale, shift)}
                res["mc2_calls"] = CALLS["npu_moe_distribute_dispatch"] - calls
                if case.get("unbounded"):
                    calls = CALLS["npu_moe_distribute_dispatch"]
                    res["unbounded"] = _round(unbounded, rank, hidden, slots, weights, placement, group, scale, shift)
                    res["unbounded_calls"] = CALLS["npu_moe_distribute_dispatch"] - calls
                results[name] = res
            if case.get("layer"):
                results["layer"] = _layer_round(limits, rank, world, group)
            if case.get("graph"):
                results["graph"] = _graph_round(mc2, rank, placement, group, h, k)
            results["report"] = mc2.ep_path_report()
            results["unbounded_report"] = unbounded.ep_path_report()
            torch.save(results, f"{out_dir}/rank{rank}.pt")
        finally:
            destroy_process_groups()
    leave_rank()


def _spawn(world: int, tmp_path, case: dict) -> list[dict]:
    mp.start_processes(_rank_main, args=(world, _free_port(), str(tmp_path), case), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _padding_counts(world: int, slots_per_rank: int, top_k: int, idle: list[int]) -> torch.Tensor:
    """Per-slot rows added by the padding row of each idle rank (its own slots first, then the next ranks')."""
    extra = torch.zeros(world * slots_per_rank, dtype=torch.int64)
    for r in idle:
        extra[(r * slots_per_rank + torch.arange(top_k)) % (world * slots_per_rank)] += 1
    return extra.view(world, slots_per_rank)


def test_mc2_equals_reference_ep_world4_relaxed_world_size(tmp_path):
    world, k, experts = 4, 3, 8
    case = {"soc": "relaxed", "dtype": torch.float32, "hidden": 32, "top_k": k, "experts": experts, "bound": 16,
            "unbounded": True, "layer": True, "graph": True,
            "rounds": {"skewed": [5, 9, 1, 16], "idle_rank": [6, 0, 11, 2]}}
    results = _spawn(world, tmp_path, case)
    spr = experts // world
    extra = _padding_counts(world, spr, k, idle=[1])
    for rank, res in enumerate(results):
        for name, tokens in case["rounds"].items():
            r = res[name]
            ref, mc2 = r["ref"], r["mc2"]
            assert r["mc2_calls"] == 1
            assert mc2["y"].shape == (tokens[rank], 32)
            assert torch.equal(mc2["y"], ref["y"]), (name, rank)
            assert torch.equal(mc2["y"], r["single"]), (name, rank)
            # fixed shape: A = global_bs * min(slots_per_rank, K) = bound * world * min(spr, K) rows
            assert mc2["rows"].shape == (16 * world * min(spr, k), 32)
            if name == "skewed":
                assert torch.equal(mc2["counts"], ref["counts"])
                n = int(ref["counts"].sum())
                assert torch.equal(mc2["rows"][:n], ref["rows"][:n])
            else:  # the idle rank's padding row is counted where it went, and nothing else changes
                assert torch.equal(mc2["counts"], ref["counts"] + extra[rank])
            # no agreed token bound: the reference path, with the reason reported
            assert r["unbounded_calls"] == 0
            assert torch.equal(r["unbounded"]["y"], ref["y"])
        assert res["report"]["ep_dispatch"].startswith("native (torch_npu.npu_moe_distribute_dispatch")
        assert "no rank-agreed bound on tokens per rank" in res["unbounded_report"]["ep_dispatch"]
        assert res["unbounded_report"]["ep_combine"].startswith("fallback (MC2")
    assert int(sum(r["skewed"]["mc2"]["counts"].sum() for r in results)) == sum(case["rounds"]["skewed"]) * k
    for res in results:
        layer = res["layer"]
        assert layer["mc2_calls"] == 1 and layer["reference_calls"] == 0
        assert torch.equal(layer["mc2"], layer["reference"])
        torch.testing.assert_close(layer["mc2"], layer["single"], rtol=1e-6, atol=1e-6)  # GEMMs over other row sets
        graph = res["graph"]
        assert graph["tasks"] > 0 and torch.equal(graph["replayed"], graph["eager"])


def test_mc2_world8_under_a3_limits(tmp_path):
    """The smallest documented A3 world size, its fixed H = 7168, bf16, K = 8 (2 slots a rank)."""
    world, k, experts = 8, 8, 16
    case = {"soc": "a3", "dtype": torch.bfloat16, "hidden": 7168, "top_k": k, "experts": experts, "bound": 8,
            "rounds": {"skewed": [3, 1, 4, 1, 5, 8, 2, 6]}}
    results = _spawn(world, tmp_path, case)
    for rank, res in enumerate(results):
        r = res["skewed"]
        ref, mc2 = r["ref"], r["mc2"]
        assert r["mc2_calls"] == 1
        assert torch.equal(mc2["counts"], ref["counts"])
        n = int(ref["counts"].sum())
        assert torch.equal(mc2["rows"][:n], ref["rows"][:n])
        assert mc2["y"].dtype == torch.bfloat16
        assert torch.equal(mc2["y"], ref["y"]) and torch.equal(mc2["y"], r["single"])
        assert "(MC2, A3)" in res["report"]["ep_dispatch"]


# ---- the contract's limits, in-process (checked before any communication) --------------------------------------
def _dispatch_args(bs=4, h=7168, k=8, world=8, experts=16, dtype=torch.bfloat16, ids=None):
    x = torch.zeros(bs, h, dtype=dtype)
    if ids is None:
        ids = (torch.arange(bs).unsqueeze(1) + torch.arange(k)) % experts
    return (x, ids.to(torch.int32), "emulated_hccl_0", world, 0, experts)


@pytest.mark.parametrize("soc,kwargs,match", [
    ("A3", dict(k=9, experts=16), "K=9"),
    ("A3", dict(bs=513), "BS=513"),
    ("A3", dict(bs=0), "BS=0"),
    ("A3", dict(world=4, experts=16), "ep_world_size=4"),
    ("A2", dict(world=8, h=4096, experts=16), "ep_world_size=8"),
    ("A2", dict(world=16, h=4096, experts=16 * 25), "25 experts per rank"),
    ("A3", dict(h=4096), "H=4096"),
    ("A3", dict(dtype=torch.float32), "x dtype"),
    ("A3", dict(experts=12), "divisible by ep_world_size"),
    ("A3", dict(bs=2, k=2, ids=torch.tensor([[1, 1], [2, 3]])), "must differ"),
    ("A3", dict(), "names no communicator"),
])
def test_dispatch_contract_errors(soc, kwargs, match):
    with emulated_npu() as npu, ops_ep.use_soc(getattr(ops_ep, soc)):
        with pytest.raises(ContractError, match=match):
            npu.npu_moe_distribute_dispatch(*_dispatch_args(**kwargs))


def test_dispatch_refuses_bs_above_global_bs_reserved_mask_and_small_buffer(monkeypatch):
    with emulated_npu() as npu, ops_ep.use_soc(ops_ep.A3):
        monkeypatch.setenv("HCCL_BUFFSIZE", "5")
        with pytest.raises(ContractError, match="HCCL_BUFFSIZE=5 MB; A3 needs >= 7.6 MB"):
            npu.npu_moe_distribute_dispatch(*_dispatch_args(bs=8, experts=16))
        monkeypatch.delenv("HCCL_BUFFSIZE")
        with pytest.raises(ContractError, match="global_bs=16"):
            npu.npu_moe_distribute_dispatch(*_dispatch_args(bs=4), global_bs=16)  # max_bs 2 < BS 4
        with pytest.raises(ContractError, match="x_active_mask is reserved"):
            npu.npu_moe_distribute_dispatch(*_dispatch_args(), x_active_mask=torch.ones(4, dtype=torch.bool))


def test_decision_reasons_per_soc():
    fits = caps.decide_ep(STRICT_A3_LIMITS, 8, 7168, 8, torch.bfloat16, 256, 128, hccl_buffsize_mb=1024)
    assert fits.native and "global_bs = 128 x 8" in fits.detail
    # DeepSeek-V3 on 8 A3 dies, 128 tokens a rank: the docs' formula wants ~946 MB of HCCL buffer, CANN's default is 200
    small = caps.decide_ep(STRICT_A3_LIMITS, 8, 7168, 8, torch.bfloat16, 256, 128)
    assert not small.native and "HCCL_BUFFSIZE 200 MB < the 946 MB" in small.detail, small.detail
    for args, reason in [((4, 7168, 8, torch.bfloat16, 256, 128), "ep_world_size 4"),
                         ((8, 7168, 9, torch.bfloat16, 256, 128), "top_k 9"),
                         ((8, 4096, 8, torch.bfloat16, 256, 128), "hidden 4096"),
                         ((8, 7168, 8, torch.float32, 256, 128), "dtype torch.float32"),
                         ((8, 7168, 8, torch.bfloat16, 1024, 128), "1024 expert slots"),
                         ((8, 7168, 8, torch.bfloat16, 256, 1024), "BS takes <= 512"),
                         ((8, 7168, 8, torch.bfloat16, 256, None), "no rank-agreed bound")]:
        d = caps.decide_ep(STRICT_A3_LIMITS, *args)
        assert not d.native and reason in d.detail, (args, d.detail)
    a2 = caps.decide_ep(dataclasses.replace(caps.A2_A3, mc2=caps.MC2_A2), 16, 4096, 8, torch.bfloat16, 256, 128)
    assert not a2.native and "expand_scales" in a2.detail
    assert "not identified" in caps.decide_ep(caps.A2_A3, 8, 7168, 8, torch.bfloat16, 256, 128).detail
    assert caps.mc2_for_device("Ascend910_9391") is caps.MC2_A3
    assert caps.mc2_for_device("Ascend910B3") is caps.MC2_A2
    assert caps.detect_profile("Ascend910_9391", emulated=False).mc2 is caps.MC2_A3


def test_ep_path_report_before_the_first_forward():
    from deepinfer_npu.backends.ascend.kernels import AscendKernelSet

    unknown = AscendKernelSet(caps.A2_A3).ep_path_report()["ep_dispatch"]
    assert unknown.startswith("fallback (MC2 not used: the SoC is not identified"), unknown
    pending = AscendKernelSet(STRICT_A3_LIMITS).ep_path_report()
    assert pending["ep_combine"].startswith("pending (MC2, A3,") and "ep_max_tokens_per_rank" in pending["ep_dispatch"]
