"""Expert-parallel dispatch / combine: latency and bandwidth against tokens per rank, and a MoE layer's time split.

Spawns ``--world`` rank processes (gloo on CPU, NCCL with ``--backend cuda``, one GPU a rank) and times the
reference ``ep_dispatch`` / ``ep_combine`` (all_to_all_single with variable splits) on DeepSeek-V2-Lite's MoE
shape (hidden 2048, 64 routed experts, top-6, expert intermediate 1408) with random routing, then one whole
expert-parallel MoE layer split into gating / dispatch / experts / combine. Prints JSON lines (rank 0's
medians; bytes = the rows this rank sends, hidden-size x dtype each).

    python -m benchmarks.bench_ep --world 2 --tokens 1 16 64 256
    python -m benchmarks.bench_ep --world 8 --backend cuda --dtype bfloat16   # one GPU per rank
    python -m benchmarks.bench_ep --memory parity_tests/models/deepseek-v2-lite-dims-2l --ep 1 2 4

``--memory DIR``: weight bytes per rank of the engine at each EP size (dummy weights, DIR's config with the
vocabulary of DeepSeek-V2-Lite), measured on the rank processes, and scaled to ``--scale-layers`` layers from the
measured per-layer sizes (the first ``first_k_dense_replace`` layers dense, the rest MoE).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_npu.backends.cpu import moe as ref
from deepinfer_npu.benchmark_meta import row_meta
from deepinfer_npu.backends.cpu.ep_comm import ep_combine, ep_dispatch
from deepinfer_npu.distributed.expert_placement import ExpertPlacement
from deepinfer_npu.distributed.parallel_state import DistributedConfig, destroy_process_groups, init_process_groups
from deepinfer_npu.hal.types import GatingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, iters: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), out


def init_rank(rank: int, args, port: int):
    """In a rank process of ``spawn_ranks``: one thread, this rank's device (one GPU a rank with ``--backend
    cuda``) and its process groups (NCCL, else gloo) -> (device, groups)."""
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if args.backend == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_process_groups(DistributedConfig(rank=rank, world_size=args.world, local_rank=rank,
                                                   master_port=port, timeout_s=args.timeout),
                                 "nccl" if device.type == "cuda" else "gloo")
    return device, groups


def spawn_ranks(rank_main, args) -> list[dict]:
    """Run ``rank_main(rank, args, port, queue)`` in ``args.world`` spawned processes on a free local port;
    -> the rows they put on the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(args, port, queue), nprocs=args.world, join=True, start_method="spawn")
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    return rows


def _rank_main(rank: int, args, port: int, queue) -> None:
    device, groups = init_rank(rank, args, port)
    dtype = getattr(torch, args.dtype)
    try:
        placement = ExpertPlacement.contiguous(args.experts, args.world)
        mine = placement.local_experts(rank)
        g = torch.Generator().manual_seed(rank)
        w13 = (torch.randn(len(mine), 2 * args.inter, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
        w2 = (torch.randn(len(mine), args.hidden, args.inter, generator=g) / args.inter**0.5).to(device, dtype)
        router = torch.randn(args.experts, args.hidden, generator=g).to(device)
        gating = GatingParams(top_k=args.top_k, num_experts=args.experts, scoring_func="softmax",
                              topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False,
                              routed_scaling_factor=1.0)
        for tokens in args.tokens:
            hidden = torch.randn(tokens, args.hidden, generator=g).to(device, dtype)
            for _ in range(args.warmup):
                rows, local, handle = ep_dispatch(hidden, placement.route(
                    torch.randint(0, args.experts, (tokens, args.top_k), generator=g).to(device)), placement,
                    groups.device_group)
                ep_combine(rows, handle, torch.ones(tokens, args.top_k, device=device), groups.device_group)
            split = {"gating_us": [], "dispatch_us": [], "experts_us": [], "combine_us": []}

            def gate():
                return ref.moe_gating_topk(hidden.float() @ router.t(), None, gating)

            for _ in range(args.iters):
                t_gate, (weights, ids) = _timed(gate, device, 1)
                slots = placement.route(ids)
                t_disp, (rows, local, handle) = _timed(
                    lambda: ep_dispatch(hidden, slots, placement, groups.device_group), device, 1)

                def experts():
                    srt, counts, state = ref.moe_dispatch(rows, local.view(-1, 1), len(mine))
                    out = ref.grouped_mlp(srt, counts, w13, w2)
                    return ref.moe_combine(out, state, torch.ones(rows.shape[0], 1, device=device))

                t_exp, out = _timed(experts, device, 1)
                t_comb, _ = _timed(lambda: ep_combine(out, handle, weights, groups.device_group), device, 1)
                for key, t in zip(split, (t_gate, t_disp, t_exp, t_comb)):
                    split[key].append(t)
            sent = sum(handle.send_counts) * args.hidden * hidden.element_size()
            med = {k: statistics.median(v) for k, v in split.items()}
            if rank == 0:
                queue.put({
                    "bench": "ep_dispatch_combine", "backend": args.backend,
                    "world": args.world, "tokens_per_rank": tokens, "hidden": args.hidden, "top_k": args.top_k,
                    "experts": args.experts, "dtype": args.dtype, "bytes_sent": sent,
                    **{k: round(v, 1) for k, v in med.items()},
                    "dispatch_GBps": round(sent / med["dispatch_us"] / 1e3, 3),
                    "combine_GBps": round(sent / med["combine_us"] / 1e3, 3),
                })
    finally:
        destroy_process_groups()


def memory_rows(args) -> list[dict]:
    import tempfile
    from pathlib import Path

    from deepinfer_npu import LLM

    cfg = json.loads((Path(args.memory) / "config.json").read_text())
    cfg["vocab_size"] = args.vocab
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        layer_bytes = None
        for ep in args.ep:
            llm = LLM(tmp, load_format="dummy", dtype=args.dtype, num_kv_blocks=8, max_num_seqs=4,
                      data_parallel_size=ep)
            engine = llm.llm_engine
            if ep == 1:
                from deepinfer_npu.distributed.rank_worker import weight_bytes

                model = engine.runner.model
                info = [weight_bytes(model)]
                layer_bytes = {}
                for name, p in model.named_parameters():
                    key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
                    part = "experts" if ".experts." in name else "other"
                    layer_bytes[(key, part)] = layer_bytes.get((key, part), 0) + p.numel() * p.element_size()
            else:
                info = engine.rank_info
                engine.shutdown()
            dense = cfg.get("first_k_dense_replace", 0)
            fixed = layer_bytes[("rest", "other")] + sum(layer_bytes.get((str(i), "other"), 0) for i in range(dense))
            moe_other = layer_bytes[(str(dense), "other")]
            moe_experts_full = layer_bytes[(str(dense), "experts")]
            n_moe = args.scale_layers - dense
            for rank, r in enumerate(info):
                scaled = fixed + n_moe * (moe_other + r["expert_weight_bytes"] / (cfg["num_hidden_layers"] - dense))
                rows.append({"bench": "ep_memory", **row_meta(), "model_config": args.memory, "vocab": args.vocab,
                             "dtype": args.dtype, "ep": ep, "rank": rank, "layers": cfg["num_hidden_layers"],
                             "weight_GiB": round(r["weight_bytes"] / 2**30, 3),
                             "expert_weight_GiB": round(r["expert_weight_bytes"] / 2**30, 3),
                             "scaled_layers": args.scale_layers, "scaled_weight_GiB": round(scaled / 2**30, 2),
                             "scaled_full_experts_GiB": round(n_moe * moe_experts_full / 2**30, 2)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--memory", default=None, help="model dir: weight memory per rank instead of dispatch timings")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--vocab", type=int, default=102400)
    p.add_argument("--scale-layers", type=int, default=27)
    args = p.parse_args()
    if args.memory:
        for row in memory_rows(args):
            print(json.dumps(row), flush=True)
        return
    rows = spawn_ranks(_rank_main, args)
    meta = row_meta("cuda:0" if args.backend == "cuda" else None)  # the parent's command line, not a child's
    for row in rows:
        print(json.dumps({"bench": row.pop("bench"), **meta, **row}), flush=True)


if __name__ == "__main__":
    main()
