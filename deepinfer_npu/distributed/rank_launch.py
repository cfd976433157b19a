"""Starting a deployment from node 0's front-end: which global ranks a node runs, the other nodes (or torchrun's
rank processes) joined and checked, then this node's ranks started.

Three layouts: one node (every rank a spawned process, rendezvous on a free local port); several nodes (node 0
hosts the rendezvous store, every other node runs ``node_server``); torchrun (this process is rank 0, every other
rank a process of its own, rendezvous on torchrun's store).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

from deepinfer_npu.config import EngineConfig

from .control_link import connect_store, control_group, read_hello
from .parallel_state import DEFAULT_MASTER_PORT
from .rank_worker import RankSpec, rank_process_main
from .remote_ranks import RemoteInbox, RemoteNode, RemoteRank
from .torchrun import ThreadRank, launched_by_torchrun, rendezvous, torchrun_config

# engine options that may differ between nodes: where the files are, which node it is, how it reached node 0
PER_NODE_FIELDS = ("model", "speculative_model", "node_rank", "master_addr", "master_port")


def node_ranks(config: EngineConfig, node_rank: int) -> range:
    """The global ranks node ``node_rank`` runs: ``node_rank * ranks_per_node + local_rank``."""
    per_node = config.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def config_difference(mine: EngineConfig, theirs: EngineConfig, who: str) -> str | None:
    """The first engine option (other than ``PER_NODE_FIELDS``) ``who`` runs differently, said; None if none."""
    for field in dataclasses.fields(EngineConfig):
        if field.name in PER_NODE_FIELDS:
            continue
        a, b = getattr(mine, field.name), getattr(theirs, field.name)
        if a != b:
            return (f"{who} runs {field.name}={b!r}, node 0 runs {field.name}={a!r}: every node must pass the same "
                    "engine options")
    return None


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
        proc = ctx.Process(target=rank_process_main, args=(spec, inbox, outbox), name=f"deepinfer-dp-rank{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)
        inboxes.append(inbox)
    return procs, inboxes


@dataclass
class Deployment:
    """Every rank as the front-end addresses it (``procs[r]`` / ``inboxes[r]``: a process and its queue, a thread
    rank, or a ``RemoteRank`` / ``RemoteInbox`` of another node) and what must outlive them."""

    procs: list
    inboxes: list
    nodes: list[RemoteNode]
    store: object | None  # the rendezvous store, when this process holds it
    master_addr: str
    master_port: int


def launch(config: EngineConfig, ctx, outbox, *, master_port: int | None, heartbeat_s: float) -> Deployment:
    """Join the other nodes (each checked against ``config``), then start this node's ranks."""
    timeout_s = float(config.distributed_timeout_s)
    env = torchrun_config(config) if launched_by_torchrun() else None
    if env is not None:
        addr, port, store = env.master_addr, env.master_port, rendezvous(env)
        members = [(rank, range(rank, rank + 1), f"DP rank {rank}'s process") for rank in range(1, env.world_size)]
    else:
        addr = config.master_addr or "127.0.0.1"
        port = master_port or config.master_port or (DEFAULT_MASTER_PORT if config.nnodes > 1 else _free_port())
        store = connect_store(addr, port, timeout_s, host=True) if config.nnodes > 1 else None
        members = [(node, node_ranks(config, node), None) for node in range(1, config.nnodes)]
    nodes = _join(config, store, members, outbox, heartbeat_s) if members else []
    try:
        if env is not None:
            rank0 = ThreadRank(config, env, store, outbox, heartbeat_s)
            procs, inboxes = [rank0], [rank0.inbox]
        else:
            procs, inboxes = spawn_ranks(config, ctx, outbox, node_rank=0, master_addr=addr, master_port=port,
                                         heartbeat_s=heartbeat_s)
    except BaseException:
        _close(nodes, timeout_s)
        raise
    procs += [RemoteRank(node, rank) for node in nodes for rank in node.ranks]
    inboxes += [RemoteInbox(node, rank) for node in nodes for rank in node.ranks]
    return Deployment(procs, inboxes, nodes, store, addr, port)


def _join(config: EngineConfig, store, members: list[tuple[int, range, str | None]], outbox,
          heartbeat_s: float) -> list[RemoteNode]:
    """The control group with every other member ``(member, its ranks, label)``: nodes, or torchrun's rank
    processes (waits up to the timeout for each to start). A member whose options differ is refused."""
    timeout_s = float(config.distributed_timeout_s)
    group = control_group(store, 0, len(members) + 1, timeout_s)
    nodes = [RemoteNode(group, member, ranks, outbox, heartbeat_s=heartbeat_s, label=label)
             for member, ranks, label in members]
    for node in nodes:
        problem = config_difference(config, read_hello(store, node.node), node.describe())
        if problem:
            node.link.send(("refused", problem))
            _close(nodes, timeout_s)
            raise ValueError(problem)
    return nodes


def _close(nodes: list[RemoteNode], timeout_s: float) -> None:
    for node in nodes:
        node.close(min(timeout_s, 30.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
