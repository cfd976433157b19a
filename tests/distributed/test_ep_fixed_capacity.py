"""The fixed-capacity expert-parallel dispatch/combine across real processes (gloo on 127.0.0.1) against the
variable-split reference (backends/cpu/ep_comm.py through CpuKernelSet): the same rows per slot and, for the same
expert outputs, the same combined output bit for bit in fp32 and bf16; no host read; a clear error for a capacity
that is too small; padding rows' garbage never reaches a token; the kernel-set path choice; a DeepSeek MoE layer."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.distributed.ep_decode_path import agreed_ep_tokens
from deepinfer_npu.distributed.ep_fixed_capacity import (FixedCapacityHandle, check_capacity, ep_combine_fixed,
                                                         ep_dispatch_fixed)
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from deepinfer_npu.hal import sync_guard
from tests.distributed.rank_exit import leave_rank

D = 16
SLOTS_PER_RANK = 4


FixedCpuKernels = CpuKernelSet  # the reference kernel set takes the decode-size fixed-capacity path too


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case(rank: int, world: int, seed: int, tokens: list[int], k: int, skew: bool, dtype=torch.float32):
    """This rank's hidden [T, D], slots [T, k] (duplicates allowed) and weights [T, k]; skewed: all on rank 0."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = tokens[rank]
    hidden = torch.randn(n, D, generator=g).to(dtype)
    high = SLOTS_PER_RANK if skew else SLOTS_PER_RANK * world
    slots = torch.randint(0, high, (n, k), generator=g)
    weights = torch.rand(n, k, generator=g)
    return hidden, slots, weights


def _expert(rows: torch.Tensor, tokens_per_slot: torch.Tensor, padding: float = 0.0) -> torch.Tensor:
    """A per-row expert output that depends only on the row and its slot (exact in any layout): rows * (slot + 1)
    + slot; rows past the counts (padding) are set to ``padding``."""
    slot = torch.repeat_interleave(torch.arange(tokens_per_slot.shape[0], device=rows.device), tokens_per_slot)
    real = slot.shape[0]
    out = torch.full_like(rows, padding)
    scale = (slot + 1).to(rows.dtype).unsqueeze(1)
    out[:real] = rows[:real] * scale + slot.to(rows.dtype).unsqueeze(1)
    return out


class _StrictReads:
    """Every host read of tensor values inside the block, wherever it is made (kernel files and ``allow_sync``
    blocks included, unlike the engine's ``HostReadDetector``, which exempts both): ``bincount`` counts too (its
    output size is data-dependent on a device)."""

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        reads = self.reads = []

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name == "bincount" or sync_guard._is_sync_call(func, args, kwargs):
                    reads.append(name)
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _compare_paths(world: int, rank: int, group, out: dict) -> None:
    ref = CpuKernelSet()
    placement = ExpertPlacement(SLOTS_PER_RANK * world, world, tuple(range(SLOTS_PER_RANK * world)))
    cases = []
    for k in range(1, 7):
        cases.append((f"random-k{k}", [3 + r for r in range(world)], k, False, torch.float32))
        cases.append((f"skewed-k{k}", [4] * world, k, True, torch.float32))
        cases.append((f"empty-rank-k{k}", [0] + [5] * (world - 1), k, False, torch.float32))
    cases.append(("bf16", [6, 2, 1, 3][:world], 4, False, torch.bfloat16))
    cases.append(("all-empty-but-one", [0] * (world - 1) + [2], 2, True, torch.float32))
    for seed, (name, tokens, k, skew, dtype) in enumerate(cases):
        hidden, slots, weights = _case(rank, world, seed, tokens, k, skew, dtype)
        want_d = ref.ep_dispatch(hidden, slots, placement, group)
        want = ref.ep_combine(_expert(want_d.rows, want_d.tokens_per_slot), want_d, weights, group)
        extra = seed % 3  # more capacity than needed changes nothing
        rows, counts, handle = ep_dispatch_fixed(hidden, slots, placement, group, max(tokens) * k + extra)
        got = ep_combine_fixed(_expert(rows, counts), handle, weights, group)
        nan = ep_combine_fixed(_expert(rows, counts, float("nan")), handle, weights, group)
        real = int(counts.sum())
        out.setdefault("cases", {})[name] = dict(
            counts=(counts, want_d.tokens_per_slot), rows=(rows[:real], want_d.rows), padding_rows=rows.shape[0] - real,
            capacity_rows=world * (max(tokens) * k + extra), out=(got, want), nan_padding=(nan, want),
            num_tokens=tokens[rank])


def _no_host_sync(world: int, rank: int, group, out: dict) -> None:
    placement = ExpertPlacement(SLOTS_PER_RANK * world, world, tuple(range(SLOTS_PER_RANK * world)))
    hidden, slots, weights = _case(rank, world, 99, [5] * world, 3, False)
    with sync_guard.forbid_sync(), sync_guard.HostReadDetector() as engine, _StrictReads() as strict:
        rows, counts, handle = ep_dispatch_fixed(hidden, slots, placement, group, 15)
        ep_combine_fixed(rows * 2, handle, weights, group)
    out["fixed_reads"] = (engine.reads, strict.reads)
    ref = CpuKernelSet()
    with sync_guard.forbid_sync(), _StrictReads() as strict:
        d = ref.ep_dispatch(hidden, slots, placement, group)
        ref.ep_combine(d.rows * 2, d, weights, group)
    out["reference_reads"] = strict.reads


def _path_choice(world: int, rank: int, group, out: dict) -> None:
    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet

    placement = ExpertPlacement(SLOTS_PER_RANK * world, world, tuple(range(SLOTS_PER_RANK * world)))
    hidden, slots, weights = _case(rank, world, 7, [2 + r for r in range(world)], 2, False)
    fixed = FixedCpuKernels()
    states = {}
    for label, agreed in (("undeclared", None), ("decode", world + 1), ("above-bound", 1000)):
        with agreed_ep_tokens(agreed) if agreed is not None else contextlib.nullcontext():
            d = fixed.ep_dispatch(hidden, slots, placement, group)
            fixed.ep_combine(d.rows, d, weights, group)
        states[label] = isinstance(d.state, FixedCapacityHandle)
    with agreed_ep_tokens(world + 1):  # the CUDA kernel set's override, on CPU tensors
        d = CudaKernelSet().ep_dispatch(hidden, slots, placement, group)
        states["cuda-decode"] = (isinstance(d.state, FixedCapacityHandle)
                                 and d.rows.shape[0] == world * (world + 1) * 2)
        CudaKernelSet().ep_combine(d.rows, d, weights, group)
    out["fixed_path_taken"] = states


def _moe_layer(world: int, rank: int, group, out: dict) -> None:
    """A DeepSeek-V3-style MoE layer through ep_moe_forward: the fixed path (declared decode step) against the
    reference kernel set, on the same weights and tokens."""
    from deepinfer_npu.distributed.ep_moe import EPGroup, ep_moe_forward, shard_experts
    from deepinfer_npu.model_executor.layers.moe import DeepseekMoE
    from deepinfer_npu.model_executor.model_config import DeepseekModelConfig

    cfg = DeepseekModelConfig.from_dict(dict(
        model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1, hidden_size=32, moe_intermediate_size=16,
        intermediate_size=64, n_routed_experts=12, num_experts_per_tok=3, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=64, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, q_lora_rank=None,
        first_k_dense_replace=1))
    results = {}
    tokens = [3, 0, 5, 1][:world]
    hidden = torch.randn(tokens[rank], 32, generator=torch.Generator().manual_seed(rank))
    for name, kernels in (("reference", CpuKernelSet()), ("fixed", FixedCpuKernels())):
        torch.manual_seed(0)
        moe = DeepseekMoE(cfg, kernels, dtype=torch.float32, device="cpu")
        for p in moe.parameters():
            p.data.normal_(0, 0.2)
        ep = EPGroup(ExpertPlacement.contiguous(12, world), rank, group)
        shard_experts(moe, ep)
        with agreed_ep_tokens(max(tokens)):
            results[name] = ep_moe_forward(moe, hidden, ep)
    out["moe_layer"] = (results["fixed"], results["reference"])


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=world, local_rank=rank, master_port=port,
                                                   timeout_s=60))
    try:
        out: dict = {}
        _compare_paths(world, rank, groups.device_group, out)
        _no_host_sync(world, rank, groups.device_group, out)
        _path_choice(world, rank, groups.device_group, out)
        _moe_layer(world, rank, groups.device_group, out)
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_process_groups()
    leave_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_fixed_capacity_equals_reference(world, tmp_path):
    mp.start_processes(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert len(res["cases"]) == 20
        for name, case in res["cases"].items():
            for what in ("counts", "rows", "out", "nan_padding"):
                got, want = case[what]
                assert got.dtype == want.dtype and got.shape == want.shape, (name, what)
                assert torch.equal(got, want), f"rank {rank}, {name}: {what} differs from the reference path"
            assert case["out"][0].shape[0] == case["num_tokens"]
            assert case["padding_rows"] + int(case["counts"][0].sum()) == case["capacity_rows"]
        assert res["fixed_reads"] == ([], [])
        assert "tolist" in res["reference_reads"] and "bincount" in res["reference_reads"]
        assert res["fixed_path_taken"] == {"undeclared": False, "decode": True, "above-bound": False,
                                           "cuda-decode": True}
        got, want = res["moe_layer"]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_capacity_too_small_is_named():
    with pytest.raises(ValueError, match=r"capacity=11 .* T=4 tokens x k=3 .* >= T\*k = 12"):
        check_capacity(11, 4, 3)
    with pytest.raises(TypeError, match="capacity must be a host int"):
        check_capacity(torch.tensor(12), 4, 3)
    check_capacity(12, 4, 3)
    check_capacity(0, 0, 6)


def test_dispatch_checks_capacity_before_any_collective(monkeypatch):
    """A too-small capacity fails on the rank before anything is sent (so no group is needed here)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    placement = ExpertPlacement(4, 1, (0, 1, 2, 3))
    with pytest.raises(ValueError, match=r"capacity=5 .* T=3 tokens x k=2"):
        ep_dispatch_fixed(torch.zeros(3, D), torch.zeros(3, 2, dtype=torch.int64), placement, None, 5)


def test_agreed_tokens_is_validated_and_nests():
    from deepinfer_npu.distributed.ep_decode_path import current_agreed_ep_tokens

    assert current_agreed_ep_tokens() is None
    with agreed_ep_tokens(8):
        with agreed_ep_tokens(2):
            assert current_agreed_ep_tokens() == 2
        assert current_agreed_ep_tokens() == 8
    assert current_agreed_ep_tokens() is None
    with pytest.raises(ValueError, match="non-negative host int"):
        with agreed_ep_tokens(-1):
            pass


def test_report_names_each_backends_path():
    from types import SimpleNamespace

    from deepinfer_npu.backends.cuda.kernels import CudaKernelSet
    from deepinfer_npu.distributed.ep_report import ep_dispatch_report

    cuda = ep_dispatch_report(SimpleNamespace(name="cuda", dist_backend="nccl", kernels=CudaKernelSet()))
    assert cuda["ep_dispatch"].startswith("fixed-capacity all_to_all_single on nccl at decode sizes (no host sync")
    assert "variable splits for prefill" in cuda["ep_dispatch"] and "DeepEP" in cuda["ep_dispatch"]
    cpu = ep_dispatch_report(SimpleNamespace(name="cpu", dist_backend="gloo", kernels=CpuKernelSet()))
    assert cpu["ep_dispatch"].startswith("fixed-capacity all_to_all_single on gloo at decode sizes")
    plain = ep_dispatch_report(SimpleNamespace(name="cpu", dist_backend="gloo", kernels=object()))
    assert "variable splits" in plain["ep_dispatch"] and "fixed-capacity" not in plain["ep_dispatch"]
