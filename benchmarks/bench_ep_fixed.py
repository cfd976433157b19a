"""Expert-parallel dispatch + combine: the variable-split reference against the fixed-capacity path, per token count.

Spawns ``--world`` rank processes (gloo on CPU; NCCL with ``--backend cuda``, one GPU a rank) and times, on
DeepSeek-V2-Lite's MoE shape (hidden 2048, 64 routed experts, top-6) with random routing, one dispatch + combine
(the expert MLP replaced by a copy, so only the traffic and the bookkeeping are timed) of: ``variable`` (the
reference: count exchange, host read of the split sizes, variable-split all_to_all_single), ``fixed`` (equal-split
all_to_all_single at capacity = tokens x top-k, no host read) and, on CUDA, ``fixed_graph`` (the same replayed from
a captured CUDA graph). Prints JSON lines (rank 0's medians; bytes = what one rank sends in the dispatch).

    python -m benchmarks.bench_ep_fixed --world 2 --tokens 1 16 64
    python -m benchmarks.bench_ep_fixed --world 8 --backend cuda --dtype bfloat16 --tokens 1 8 32 128 256
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.bench_ep import _timed, init_rank, spawn_ranks
from deepinfer_npu.backends.cpu.ep_comm import ep_combine, ep_dispatch
from deepinfer_npu.benchmark_meta import row_meta
from deepinfer_npu.distributed.ep_fixed_capacity import ep_combine_fixed, ep_dispatch_fixed
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import destroy_process_groups


def _rank_main(rank: int, args, port: int, queue) -> None:
    device, groups = init_rank(rank, args, port)
    group, dtype = groups.device_group, getattr(torch, args.dtype)
    try:
        placement = ExpertPlacement.contiguous(args.experts, args.world)
        g = torch.Generator().manual_seed(rank)
        for tokens in args.tokens:
            hidden = torch.randn(tokens, args.hidden, generator=g).to(device, dtype)
            slots = torch.randint(0, args.experts, (tokens, args.top_k), generator=g).to(device)
            weights = torch.rand(tokens, args.top_k, generator=g).to(device)
            capacity = tokens * args.top_k  # every rank runs the same token count here

            def variable():
                rows, _local, handle = ep_dispatch(hidden, slots, placement, group)
                return ep_combine(rows.clone(), handle, weights, group)

            def fixed():
                rows, _counts, handle = ep_dispatch_fixed(hidden, slots, placement, group, capacity)
                return ep_combine_fixed(rows.clone(), handle, weights, group)

            row = {"tokens_per_rank": tokens}
            for name, fn in (("variable", variable), ("fixed", fixed)):
                for _ in range(args.warmup):
                    fn()
                row[f"{name}_us"] = round(_timed(fn, device, args.iters)[0], 1)
            if device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fixed()
                row["fixed_graph_us"] = round(_timed(graph.replay, device, args.iters)[0], 1)
            elem = hidden.element_size()
            row["variable_bytes"] = tokens * args.top_k * args.hidden * elem
            row["fixed_bytes"] = args.world * capacity * args.hidden * elem
            if rank == 0:
                queue.put(row)
    finally:
        destroy_process_groups()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    rows = spawn_ranks(_rank_main, args)
    meta = row_meta("cuda:0" if args.backend == "cuda" else None)
    for row in rows:
        print(json.dumps({"bench": "ep_fixed_vs_variable", **meta, "backend": args.backend, "world": args.world,
                          "hidden": args.hidden, "top_k": args.top_k, "experts": args.experts, "dtype": args.dtype,
                          **row}), flush=True)


if __name__ == "__main__":
    main()
