"""Expert-parallel dispatch/combine and the step vote across real processes (gloo on 127.0.0.1).

Each rank routes its own tokens; the EP result must equal the single-process reference MoE on the same tokens
(fp32; the only difference allowed is the expert GEMMs' summation order over different row counts: rtol 1e-6).
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from deepinfer_npu.backends.cpu import moe as ref
from deepinfer_npu.backends.cpu.ep_comm import ep_combine, ep_dispatch
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from deepinfer_npu.distributed.step_vote import agree_decode_size, confirm_step, vote_prefill
from deepinfer_npu.hal.types import GatingParams
from tests.distributed.rank_exit import leave_rank

E, D, I, K = 8, 32, 16, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, D, generator=g)
    w13 = torch.randn(E, 2 * I, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, I, generator=g) / I**0.5
    return router, w13, w2


def _tokens(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(100 + rank))


GATING = GatingParams(top_k=K, num_experts=E, scoring_func="softmax", topk_method="greedy", n_group=1,
                      topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)


def _reference_moe(hidden, router, w13, w2):
    weights, ids = ref.moe_gating_topk(hidden @ router.t(), None, GATING)
    sorted_hidden, counts, state = ref.moe_dispatch(hidden, ids, E)
    return ref.moe_combine(ref.grouped_mlp(sorted_hidden, counts, w13, w2), state, weights)


def _ep_moe(hidden, router, w13, w2, placement: ExpertPlacement, rank: int, group):
    weights, ids = ref.moe_gating_topk(hidden @ router.t(), None, GATING)
    rows, local_expert, handle = ep_dispatch(hidden, placement.route(ids), placement, group)
    mine = placement.local_experts(rank)
    sorted_rows, counts, state = ref.moe_dispatch(rows, local_expert.view(-1, 1), len(mine))
    out = ref.grouped_mlp(sorted_rows, counts, w13[mine], w2[mine])
    out = ref.moe_combine(out, state, torch.ones(rows.shape[0], 1))  # back to receive order (weights 1: exact)
    return ep_combine(out, handle, weights, group)


def _rank_main(rank: int, world: int, port: int, out_dir: str, tokens_per_rank: list[int], replicas: bool):
    torch.set_num_threads(1)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=world, local_rank=rank,
                                                   master_port=port, timeout_s=60))
    try:
        router, w13, w2 = _weights()
        hidden = _tokens(rank, tokens_per_rank[rank])
        if replicas:  # one extra replica of experts 0 .. world-1 (hot experts), as a load balancer would add
            slots = list(range(E)) + list(range(world))
            per = len(slots) // world
            placement = ExpertPlacement(E, world, tuple(slots[:per * world]))
        else:
            placement = ExpertPlacement.contiguous(E, world)
        got = _ep_moe(hidden, router, w13, w2, placement, rank, groups.device_group)
        want = _reference_moe(hidden, router, w13, w2)
        votes = {2: [[-1, 0], [1, 0], [1, 1]], 4: [[-1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]]}[world]
        agreed = [vote_prefill(v[rank], False, groups.cpu_group).prefill for v in votes]
        idle = [vote_prefill(0, flags[rank], groups.cpu_group).group_idle
                for flags in ([True] * world, [True] * (world - 1) + [False])]
        nobody = confirm_step(True, 0, 0, groups.cpu_group)
        somebody = confirm_step(True, int(rank == world - 1), 5 * rank, groups.cpu_group)
        size = agree_decode_size(rank + 1, groups.cpu_group)
        torch.save({"got": got, "want": want, "agreed": agreed, "nobody": nobody, "somebody": somebody,
                    "size": size, "idle": idle}, f"{out_dir}/rank{rank}.pt")
    finally:
        destroy_process_groups()
    leave_rank()


def _spawn(world: int, tmp_path, tokens_per_rank, replicas=False):
    mp.start_processes(_rank_main, args=(world, _free_port(), str(tmp_path), tokens_per_rank, replicas),
                       nprocs=world, join=True, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("world,tokens,replicas", [(2, [5, 0], False), (2, [3, 7], True)])
def test_ep_moe_equals_single_process(world, tokens, replicas, tmp_path):
    results = _spawn(world, tmp_path, tokens, replicas)
    for rank, res in enumerate(results):
        assert res["got"].shape == (tokens[rank], D)
        torch.testing.assert_close(res["got"], res["want"], rtol=1e-6, atol=1e-6)
        # the step vote: MIN of the votes (-1 forces, 1 needs every rank), second round, size MAX
        expected = {2: [True, False, True], 4: [True, False, True]}[world]
        assert res["agreed"] == expected
        assert res["idle"] == [True, False]  # idle only when every rank is
        assert not res["nobody"].prefill and not res["nobody"].any_work
        assert res["somebody"].prefill and res["somebody"].max_num_tokens == 5 * (world - 1)
        assert res["size"] == world


def test_placement_contiguous_and_replicas():
    p = ExpertPlacement.contiguous(8, 4)
    assert p.local_experts(1) == [2, 3] and p.slots_per_rank == 2
    ids = torch.tensor([[0, 7], [3, 4]])
    assert p.route(ids).tolist() == [[0, 7], [3, 4]]
    q = ExpertPlacement(4, 2, (0, 1, 2, 3, 0, 0))  # expert 0 has three replicas: slots 0, 4, 5
    slots = q.route(torch.zeros(6, 1, dtype=torch.int64)).view(-1).tolist()
    assert slots == [0, 4, 5, 0, 4, 5]  # spread by token index
    assert q.local_experts(1) == [3, 0, 0]


@pytest.mark.parametrize("bad,match", [
    (lambda: ExpertPlacement.contiguous(6, 4), "not divisible"),
    (lambda: ExpertPlacement(4, 2, (0, 1, 2, 2)), "no physical slot"),
    (lambda: ExpertPlacement(4, 2, (0, 1, 2)), "do not divide"),
    (lambda: ExpertPlacement(4, 2, (0, 1, 2, 9)), "outside"),
    (lambda: DistributedConfig(rank=2, world_size=2, local_rank=0), "outside"),
])
def test_bad_configuration_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_from_env_names_missing_variable(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK is not set"):
        DistributedConfig.from_env()
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        DistributedConfig.from_env()


def test_missing_rank_fails_within_timeout():
    cfg = DistributedConfig(rank=0, world_size=2, local_rank=0, master_port=_free_port(), timeout_s=3)
    with pytest.raises(RuntimeError, match=r"rank 0/2: could not join .* within 3 s"):
        init_process_groups(cfg)
    destroy_process_groups()
