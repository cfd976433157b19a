"""Starting one node's rank processes: which global ranks a node runs, and their spawned processes."""

from __future__ import annotations

import os

from deepinfer_npu.config import EngineConfig

from .rank_worker import RankSpec, rank_main


def node_ranks(config: EngineConfig, node_rank: int) -> range:
    """The global ranks node ``node_rank`` runs: ``node_rank * ranks_per_node + local_rank``."""
    per_node = config.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def describe_ranks(ranks: range) -> str:
    return f"DP rank {ranks[0]}" if len(ranks) == 1 else f"DP ranks {ranks[0]}..{ranks[-1]}"


def spawn_ranks(config: EngineConfig, ctx, outbox, *, node_rank: int, master_addr: str, master_port: int,
                heartbeat_s: float) -> tuple[list, list]:
    """Start the node's ranks (device = local rank); returns their processes and inboxes, in rank order."""
    procs, inboxes = [], []
    for local_rank, rank in enumerate(node_ranks(config, node_rank)):
        spec = RankSpec(rank=rank, world_size=config.data_parallel_size, master_port=master_port, config=config,
                        heartbeat_s=heartbeat_s, timeout_s=float(config.distributed_timeout_s),
                        master_addr=master_addr, local_rank=local_rank, shared_store=config.nnodes > 1,
                        parent_pid=os.getpid())
        inbox = ctx.Queue()
        proc = ctx.Process(target=rank_main, args=(spec, inbox, outbox), name=f"deepinfer-dp-rank{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)
        inboxes.append(inbox)
    return procs, inboxes
