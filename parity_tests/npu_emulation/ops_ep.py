"""CPU implementations of torch_npu's MC2 expert-parallel ops over ``torch.distributed``:
``npu_moe_distribute_dispatch`` and ``npu_moe_distribute_combine``, and the HCCL group-name accessor they take.

Docs: Ascend/op-plugin docs/context ``torch_npu-npu_moe_distribute_dispatch.md`` and
``torch_npu-npu_moe_distribute_combine.md`` (the v1 pair; the ``_v2`` pages widen A3's limits and add
``x_active_mask``, not emulated). Usage: vllm_ascend/ops/fused_moe/token_dispatcher.py (TokenDispatcherWithMC2:
a dedicated MC2 group, its name from ``group._get_backend(device).get_hccl_comm_name(rank)``,
``global_bs = max tokens per rank * ep_world_size`` when ranks differ in BS).

Every documented limit of the chosen SoC (:data:`SOC`, A3 or A2; tests may relax one explicitly with
:func:`use_soc`) raises :class:`ContractError`; the arithmetic checks come before any communication, so a call
outside the contract fails the same way on every rank that makes it. Outputs have the documented fixed shapes
(``expand_x`` [A, H] with ``A = global_bs * min(local_expert_num, K)``, ``global_bs = BS * ep_world_size`` when 0):
nothing the caller needs to size them depends on device values, which is what lets MC2 sit in a captured graph.

Where the docs leave something open, the reading here is the one vllm-ascend relies on:
- ``expand_x`` rows are grouped by local expert (``expert_token_nums`` is passed straight to
  ``npu_grouped_matmul`` as its group list), within an expert by source rank, within a source by token; rows past
  the received count are unspecified (zeros here).
- ``global_bs`` non-zero is an upper bound on every rank's BS times ``ep_world_size``
  (vllm-ascend passes its MC2 token capacity, not the step's actual maximum).
- ``expand_idx`` / ``ep_recv_counts`` / ``tp_recv_counts`` values are opaque (the docs say so): here
  ``expand_idx[t*K + j]`` is the token's position among this rank's tokens sent to expert ``expert_ids[t, j]``
  and ``ep_recv_counts`` the prefix sums of the (local expert, source rank) blocks of ``expand_x``.
- combine: ``x[t] = sum_j expert_scales[t, j] * row(t, j)`` accumulated in fp32 over ``j = 0..K-1`` (the
  accumulation order on the chip is not documented), cast to ``expand_x``'s dtype.
Not emulated: TP domains (tp_world_size 2), shared-expert ranks, quant_mode 2, communication quantisation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .contract import ContractError, check, record

HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Mc2Soc:
    """The documented limits of the MC2 pair on one SoC (both doc pages state the same ones)."""

    name: str
    ep_world_sizes: tuple[int, ...] | None  # None: any size >= 2 (relaxed in a test)
    hidden_sizes: tuple[int, ...] | None  # exact values (A3: 7168); None: the range below
    hidden_max: int | None  # A2: (0, 7168], a multiple of hidden_multiple
    hidden_multiple: int
    max_bs: int
    max_k: int
    max_local_experts: int | None  # A2: moe_expert_num / ep_world_size <= 24
    x_dtypes: tuple[torch.dtype, ...]
    takes_expert_scales: bool  # A2: dispatch takes expert_scales -> expand_scales, combine requires them
    max_experts: int = 512


#: Atlas A3: ep_world_size in {8, 16, 32, 64, 128, 144, 256, 288}, H = 7168, 0 < BS <= 512, 0 < K <= 8.
A3 = Mc2Soc(name="A3", ep_world_sizes=(8, 16, 32, 64, 128, 144, 256, 288), hidden_sizes=(7168,), hidden_max=None,
            hidden_multiple=1, max_bs=512, max_k=8, max_local_experts=None, x_dtypes=HALF,
            takes_expert_scales=False)
#: Atlas A2: ep_world_size in {16, 32, 64}, H in (0, 7168] and % 32 == 0, 0 < BS <= 256, 0 < K <= 16,
#: moe_expert_num / ep_world_size <= 24.
A2 = Mc2Soc(name="A2", ep_world_sizes=(16, 32, 64), hidden_sizes=None, hidden_max=7168, hidden_multiple=32,
            max_bs=256, max_k=16, max_local_experts=24, x_dtypes=HALF, takes_expert_scales=True)
#: The default of the emulation: A3 with H and dtype lifted, as backends/ascend/capabilities.EMULATION lifts fixed
#: dims and dtypes for every other op (small fp32 models reach the same call sites).
A3_DIMS_LIFTED = dataclasses.replace(A3, name="A3 (H and dtype lifted)", hidden_sizes=None, hidden_max=None,
                                     x_dtypes=(*HALF, torch.float32))

SOC: Mc2Soc = A3_DIMS_LIFTED


@contextlib.contextmanager
def use_soc(soc: Mc2Soc):
    """Emulate ``soc``'s limits inside the block (tests name any relaxation explicitly)."""
    global SOC
    previous, SOC = SOC, soc
    try:
        yield soc
    finally:
        SOC = previous


# ---- the HCCL group-name accessor ---------------------------------------------------------------------------
#: group name -> the process group it names (the emulation's stand-in for HCCL's communicator registry).
GROUPS: dict[str, dist.ProcessGroup] = {}


def _get_hccl_comm_name(backend, rank: int, init_comm: bool = True) -> str:
    """``ProcessGroupHCCL.get_hccl_comm_name(rank)`` on the emulation's gloo backend: a name the MC2 ops accept as
    ``group_ep``, registered with the process group whose backend object this is."""
    world = dist.distributed_c10d._world
    for pg, pg_name in world.pg_names.items():
        if pg._get_backend(torch.device("cpu")) is backend:
            check(rank == dist.get_rank(pg), f"get_hccl_comm_name({rank}): this process is rank "
                  f"{dist.get_rank(pg)} of the group")
            name = f"emulated_hccl_{pg_name}"
            GROUPS[name] = pg
            return name
    raise ContractError("get_hccl_comm_name: the backend belongs to no live process group")


def install_accessor() -> None:
    dist.ProcessGroupGloo.get_hccl_comm_name = _get_hccl_comm_name


def uninstall_accessor() -> None:
    GROUPS.clear()
    if "get_hccl_comm_name" in vars(dist.ProcessGroupGloo):
        del dist.ProcessGroupGloo.get_hccl_comm_name


# ---- shared argument checks --------------------------------------------------------------------------------------
def _check_common(op: str, bs: int, h: int, k: int, expert_ids, ep_world_size: int, ep_rank_id: int,
                  moe_expert_num: int, group_tp: str, tp_world_size: int, tp_rank_id: int, expert_shard_type: int,
                  shared_expert_num: int, shared_expert_rank_num: int, global_bs: int) -> int:
    """The limits both ops share (docs' parameter and constraint sections); -> local_expert_num."""
    soc = SOC
    check(expert_ids.dim() == 2 and expert_ids.shape == (bs, k), f"{op}: expert_ids must be [BS, K] = [{bs}, {k}]")
    check(expert_ids.dtype == torch.int32, f"{op}: expert_ids must be int32, got {expert_ids.dtype}")
    check(0 < bs <= soc.max_bs, f"{op}: BS={bs} outside 0 < BS <= {soc.max_bs} ({soc.name})")
    check(0 < k <= min(soc.max_k, moe_expert_num), f"{op}: K={k} outside 0 < K <= {soc.max_k} and <= "
          f"moe_expert_num ({soc.name})")
    if soc.hidden_sizes is not None:
        check(h in soc.hidden_sizes, f"{op}: H={h}; {soc.name} takes H in {soc.hidden_sizes}")
    if soc.hidden_max is not None:
        check(0 < h <= soc.hidden_max and h % soc.hidden_multiple == 0,
              f"{op}: H={h}; {soc.name} takes 0 < H <= {soc.hidden_max}, a multiple of {soc.hidden_multiple}")
    if soc.ep_world_sizes is not None:
        check(ep_world_size in soc.ep_world_sizes,
              f"{op}: ep_world_size={ep_world_size}; {soc.name} takes {soc.ep_world_sizes}")
    check(ep_world_size >= 2, f"{op}: ep_world_size={ep_world_size} must be >= 2")
    check(0 <= ep_rank_id < ep_world_size, f"{op}: ep_rank_id={ep_rank_id} outside [0, {ep_world_size})")
    check(1 <= moe_expert_num <= soc.max_experts and moe_expert_num % ep_world_size == 0,
          f"{op}: moe_expert_num={moe_expert_num} must be in [1, {soc.max_experts}] and divisible by "
          f"ep_world_size={ep_world_size} (no shared-expert ranks)")
    local = moe_expert_num // ep_world_size
    if soc.max_local_experts is not None:
        check(local <= soc.max_local_experts, f"{op}: {local} experts per rank; {soc.name} takes <= "
              f"{soc.max_local_experts}")
    check(group_tp == "" and tp_world_size in (0, 1) and tp_rank_id == 0,
          f"{op}: emulated without a TP domain (group_tp '', tp_world_size 0 or 1, tp_rank_id 0)")
    check(expert_shard_type == 0 and shared_expert_num == 1 and shared_expert_rank_num == 0,
          f"{op}: emulated without shared-expert ranks (expert_shard_type 0, shared_expert_num 1, "
          "shared_expert_rank_num 0)")
    check(global_bs == 0 or (global_bs % ep_world_size == 0 and bs <= global_bs // ep_world_size),
          f"{op}: global_bs={global_bs} must be 0 (equal BS on every rank) or max_bs * ep_world_size with "
          f"BS={bs} <= max_bs")
    return local


def _group(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int) -> dist.ProcessGroup:
    check(isinstance(group_ep, str) and 1 <= len(group_ep) < 128, f"{op}: group_ep must be a name of 1..127 chars")
    check(group_ep in GROUPS, f"{op}: group_ep {group_ep!r} names no communicator (take it from "
          "group._get_backend(device).get_hccl_comm_name(rank))")
    pg = GROUPS[group_ep]
    check(dist.get_world_size(pg) == ep_world_size, f"{op}: ep_world_size={ep_world_size} but the group has "
          f"{dist.get_world_size(pg)} ranks")
    check(dist.get_rank(pg) == ep_rank_id, f"{op}: ep_rank_id={ep_rank_id} but this process is rank "
          f"{dist.get_rank(pg)} of the group")
    return pg


def _agree(op: str, pg, values: list[int], names: str) -> torch.Tensor:
    """Every rank must pass the same values (docs: identical on all cards); -> the gathered BS column."""
    mine = torch.tensor(values, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(everyone, mine, group=pg)
    table = torch.stack(everyone)
    check(bool((table[:, 1:] == table[0, 1:]).all()), f"{op}: {names} differ across the ranks: {table.tolist()}")
    return table[:, 0]


def _a2_recv_counts_len(moe_expert_num: int, global_bs: int, k: int, ep_world_size: int) -> int:
    # A2: moe_expert_num + 2 * global_bs * K * server_num (8 NPUs a server: ep_world_size 16/32/64 -> 2/4/8)
    return moe_expert_num + 2 * global_bs * k * (ep_world_size // 8)


# ---- the ops -----------------------------------------------------------------------------------------------------
def npu_moe_distribute_dispatch(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
    moe_expert_num: int, *, scales=None, x_active_mask=None, expert_scales=None, group_tp: str = "",
    tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0, expert_token_nums_type: int = 1,
):
    """-> (expand_x [A, H], dynamic_scales (None: quant_mode 0), expand_idx [BS*K] int32,
    expert_token_nums [local_expert_num] int64, ep_recv_counts int32, tp_recv_counts, expand_scales)."""
    record("npu_moe_distribute_dispatch")
    op = "npu_moe_distribute_dispatch"
    soc = SOC
    check(x.dim() == 2, f"{op}: x must be 2-D [BS, H]")
    bs, h = x.shape
    k = expert_ids.shape[-1] if expert_ids.dim() == 2 else -1
    check(x.dtype in soc.x_dtypes, f"{op}: x dtype {x.dtype}; {soc.name} takes {soc.x_dtypes}")
    local = _check_common(op, bs, h, k, expert_ids, ep_world_size, ep_rank_id, moe_expert_num, group_tp,
                          tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num,
                          global_bs)
    check(quant_mode == 0 and scales is None, f"{op}: emulated unquantised only (quant_mode 0, scales None)")
    check(x_active_mask is None, f"{op}: x_active_mask is reserved (pass the default)")
    check(expert_token_nums_type in (0, 1), f"{op}: expert_token_nums_type must be 0 (prefix sums) or 1 (counts)")
    if expert_scales is not None:
        check(soc.takes_expert_scales, f"{op}: expert_scales is not supported on {soc.name}")
        check(expert_scales.shape == (bs, k) and expert_scales.dtype == torch.float32,
              f"{op}: expert_scales must be [BS, K] float32")
    world, rows_cap = ep_world_size, (global_bs or bs * ep_world_size) * min(local, k)
    max_bs, buff = (global_bs // world if global_bs else bs), int(os.environ.get("HCCL_BUFFSIZE", "200"))
    if soc.takes_expert_scales:  # A2 (fullmesh): >= 2 * (BS * ep_world_size * min(local, K) * H * 2 B + 2 MB)
        need = 2 * (max_bs * world * min(local, k) * h * 2 / 2**20 + 2)
    else:  # A3: 1024^2 * (HCCL_BUFFSIZE - 2) / 2 >= BS * 2 * (H + 128) * (ep_world_size * local + K + 1)
        need = 2 + 2 * max_bs * 2 * (h + 128) * (world * local + k + 1) / 2**20
    check(buff >= need, f"{op}: HCCL_BUFFSIZE={buff} MB; {soc.name} needs >= {need:.1f} MB for BS {max_bs}")
    ids = expert_ids.long()
    check(bool(((ids >= 0) & (ids < moe_expert_num)).all()), f"{op}: expert ids outside [0, {moe_expert_num})")
    check(bool((ids.sort(dim=1).values.diff(dim=1) != 0).all()), f"{op}: the K expert ids of a token must differ")
    pg = _group(op, group_ep, ep_world_size, ep_rank_id)
    all_bs = _agree(op, pg, [bs, ep_world_size, moe_expert_num, global_bs, h],
                    "ep_world_size / moe_expert_num / global_bs / H")
    check(global_bs != 0 or bool((all_bs == bs).all()),
          f"{op}: global_bs=0 needs the same BS on every rank, got {all_bs.tolist()}")

    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by global expert = (destination rank, local expert), then token
    per_expert = torch.bincount(flat, minlength=moe_expert_num)
    start = torch.cumsum(per_expert, 0) - per_expert
    expand_idx = torch.empty_like(flat)
    expand_idx[order] = torch.arange(flat.numel()) - start[flat[order]]
    send_counts = per_expert.view(world, local).sum(1)
    recv_per_expert = torch.empty(world, local, dtype=torch.int64)  # [source rank, local expert]
    dist.all_to_all_single(recv_per_expert, per_expert.view(world, local).contiguous(), group=pg)
    recv_counts = recv_per_expert.sum(1)
    payload = x[order // k]
    if expert_scales is not None:
        payload = torch.cat([payload.view(-1, h).float(), expert_scales.reshape(-1)[order].unsqueeze(1)], 1)
    received = payload.new_empty(int(recv_counts.sum()), payload.shape[1])
    dist.all_to_all_single(received, payload.contiguous(), output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist(), group=pg)
    # received: source-major, then local expert, then token -> expand_x: local expert-major, then source, token
    block = recv_per_expert.t().reshape(-1)  # [local expert, source] block sizes, in expand_x order
    src_block_start = (torch.cumsum(recv_per_expert.reshape(-1), 0) - recv_per_expert.reshape(-1)).view(world, local)
    gather = torch.cat([torch.arange(int(recv_per_expert[s, e])) + src_block_start[s, e]
                        for e in range(local) for s in range(world)])
    check(received.shape[0] <= rows_cap, f"{op}: {received.shape[0]} rows received exceed A={rows_cap}")
    ordered = received[gather]
    expand_x = x.new_zeros(rows_cap, h)
    expand_x[: ordered.shape[0]] = ordered[:, :h].to(x.dtype)
    counts = recv_per_expert.sum(0)
    expert_token_nums = counts if expert_token_nums_type == 1 else torch.cumsum(counts, 0)
    if soc.takes_expert_scales:  # A2 layout: per-expert prefix sums, then the (unspecified) pre-reduce table
        ep_recv_counts = torch.zeros(_a2_recv_counts_len(moe_expert_num, global_bs or bs * world, k, world),
                                     dtype=torch.int32)
        ep_recv_counts[: world * local] = torch.cumsum(block, 0).to(torch.int32)
        tp_recv_counts = None
        expand_scales = torch.zeros(rows_cap, dtype=torch.float32)
        if expert_scales is not None:
            expand_scales[: ordered.shape[0]] = ordered[:, h]
    else:  # A3: ep_world_size * max(tp_world_size, 1) * local_expert_num
        ep_recv_counts = torch.cumsum(block, 0).to(torch.int32)
        tp_recv_counts = torch.zeros(tp_world_size, dtype=torch.int32)
        expand_scales = None
    return (expand_x, None, expand_idx.to(torch.int32), expert_token_nums.to(torch.int64), ep_recv_counts,
            tp_recv_counts, expand_scales)


def npu_moe_distribute_combine(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor, ep_send_counts: torch.Tensor,
    expert_scales: torch.Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    tp_send_counts=None, x_active_mask=None, activation_scale=None, weight_scale=None, group_list=None,
    expand_scales=None, shared_expert_x=None, group_tp: str = "", tp_world_size: int = 0, tp_rank_id: int = 0,
    expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0, global_bs: int = 0,
    out_dtype: int = 0, comm_quant_mode: int = 0, group_list_type: int = 0,
) -> torch.Tensor:
    """The dispatch's path in reverse: rows back to their tokens' ranks, ``x[t] = sum_j expert_scales[t, j] *
    row(t, j)`` in fp32 -> [BS, H] in ``expand_x``'s dtype."""
    record("npu_moe_distribute_combine")
    op = "npu_moe_distribute_combine"
    soc = SOC
    check(expand_x.dim() == 2, f"{op}: expand_x must be 2-D [A, H]")
    check(expand_x.dtype in soc.x_dtypes, f"{op}: expand_x dtype {expand_x.dtype}; {soc.name} takes {soc.x_dtypes}")
    bs, k = expert_ids.shape if expert_ids.dim() == 2 else (-1, -1)
    h = expand_x.shape[1]
    local = _check_common(op, bs, h, k, expert_ids, ep_world_size, ep_rank_id, moe_expert_num, group_tp,
                          tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num,
                          global_bs)
    world = ep_world_size
    rows_cap = (global_bs or bs * world) * min(local, k)
    check(expand_x.shape[0] == rows_cap, f"{op}: expand_x has {expand_x.shape[0]} rows, the dispatch gave A="
          f"{rows_cap}")
    check(expand_idx.dtype == torch.int32 and expand_idx.shape == (bs * k,), f"{op}: expand_idx must be int32 [BS*K]")
    check(expert_scales.dtype == torch.float32 and expert_scales.shape == (bs, k),
          f"{op}: expert_scales must be float32 [BS, K]")
    check(ep_send_counts.dtype == torch.int32, f"{op}: ep_send_counts must be int32")
    if soc.takes_expert_scales:
        check(ep_send_counts.shape == (_a2_recv_counts_len(moe_expert_num, global_bs or bs * world, k, world),),
              f"{op}: ep_send_counts shape (A2: moe_expert_num + 2*global_bs*K*server_num)")
        check(expand_scales is not None and expand_scales.shape == (rows_cap,), f"{op}: expand_scales [A] is "
              f"required on {soc.name}")
    else:
        check(ep_send_counts.shape == (world * max(tp_world_size, 1) * local,),
              f"{op}: ep_send_counts must be [ep_world_size * max(tp_world_size, 1) * local_expert_num]")
        check(expand_scales is None, f"{op}: expand_scales is not supported on {soc.name}")
    check(all(t is None for t in (x_active_mask, activation_scale, weight_scale, group_list, shared_expert_x)),
          f"{op}: x_active_mask / activation_scale / weight_scale / group_list / shared_expert_x are reserved")
    check(comm_quant_mode == 0 and out_dtype == 0 and group_list_type == 0,
          f"{op}: emulated without communication quantisation (comm_quant_mode 0, out_dtype 0)")
    ids = expert_ids.long()
    check(bool(((ids >= 0) & (ids < moe_expert_num)).all()), f"{op}: expert ids outside [0, {moe_expert_num})")
    pg = _group(op, group_ep, ep_world_size, ep_rank_id)
    _agree(op, pg, [bs, ep_world_size, moe_expert_num, global_bs, h], "ep_world_size / moe_expert_num / global_bs / H")

    # expert side: block (local expert e, source s) of expand_x goes back to s, sources in rank order
    block_end = ep_send_counts[: world * local].long()
    block = torch.diff(block_end, prepend=block_end.new_zeros(1)).view(local, world)  # [e, s]
    block_start = (block_end - block.reshape(-1)).view(local, world)
    back = torch.cat([torch.arange(int(block[e, s])) + block_start[e, s] for s in range(world) for e in range(local)])
    send_counts = block.sum(0)
    # token side: what comes back from each destination, in (local expert, token) order
    flat = ids.reshape(-1)
    per_expert = torch.bincount(flat, minlength=moe_expert_num).view(world, local)
    recv_counts = per_expert.sum(1)
    received = expand_x.new_empty(int(recv_counts.sum()), h)
    dist.all_to_all_single(received, expand_x[back].contiguous(), output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist(), group=pg)
    expert_start = (torch.cumsum(per_expert.reshape(-1), 0) - per_expert.reshape(-1))
    rows = received[expert_start[flat] + expand_idx.long()]  # row of (t, j), flat order t*K + j
    per_token = rows.float().view(bs, k, h)
    return (per_token * expert_scales.float().unsqueeze(-1)).sum(dim=1).to(expand_x.dtype)
