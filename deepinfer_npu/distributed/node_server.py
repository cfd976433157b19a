"""A node other than node 0, headless: it starts its ranks and relays between them and node 0's front-end.

``serve_node(config)`` (``python -m deepinfer_npu.run --nnodes M --node-rank R --master-addr A ...``) reaches the
rendezvous store node 0 hosts at ``master_addr:master_port``, spawns the node's ``data_parallel_size / nnodes``
ranks (they join every other rank there: expert-parallel traffic and the step vote go rank to rank, not through
this process), joins the control group and forwards messages both ways (``remote_ranks`` gives the protocol).
It returns when the front-end says goodbye, after its ranks have stopped: 0 if they all exited cleanly. If the
front-end's link fails or stays silent for ``distributed_timeout_s``, it stops its ranks and raises
``RuntimeError`` naming node 0. ``serve_rank(config)`` is the same for one torchrun process other than RANK 0: its
rank on a thread, relayed to rank 0's front-end.
"""

from __future__ import annotations

import queue as queue_mod
import time

import torch.multiprocessing as mp

from deepinfer_npu.config import EngineConfig

from .control_link import ControlLink, connect_store, control_group
from .parallel_state import DEFAULT_MASTER_PORT
from .rank_launch import node_ranks, spawn_ranks
from .remote_ranks import describe_ranks
from .torchrun import ThreadRank, rendezvous, torchrun_config


def serve_node(config: EngineConfig, *, heartbeat_s: float = 1.0) -> int:
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError(f"serve_node runs node 1..nnodes-1 of a multi-node deployment, got node_rank="
                         f"{config.node_rank} of nnodes={config.nnodes} (node 0 runs the front-end: LLM(...))")
    timeout_s = float(config.distributed_timeout_s)
    addr, port = config.master_addr, config.master_port or DEFAULT_MASTER_PORT
    front_end = f"the front-end (node 0, {addr}:{port})"
    ranks = node_ranks(config, config.node_rank)
    store = connect_store(addr, port, timeout_s, host=False)
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()  # the ranks' messages, and (tagged) the front-end's

    def start() -> tuple[list, list]:
        return spawn_ranks(config, ctx, outbox, node_rank=config.node_rank, master_addr=addr, master_port=port,
                           heartbeat_s=heartbeat_s)

    return serve_ranks(store, config.node_rank, config.nnodes, start, outbox, ranks, config=config,
                       timeout_s=timeout_s, heartbeat_s=heartbeat_s, front_end=front_end)


def serve_ranks(store, member: int, members: int, start, outbox, ranks: range, *, config: EngineConfig,
                timeout_s: float, heartbeat_s: float, front_end: str) -> int:
    """Join the control group as ``member`` (announcing ``config``, which the front-end checks against its own),
    then start the ``ranks`` (``start()`` gives their processes and inboxes) and relay for them until the
    front-end's goodbye; then stop them and answer with their exit codes. 0 if they all exited cleanly.

    The group is formed before the ranks start: a rank waiting for its peers in the store must not hold up this
    process's own use of it (torchrun: one store client per process)."""
    procs, inboxes = [], []
    try:
        group = control_group(store, member, members, timeout_s, hello=config)
        link = ControlLink(group, 0, on_message=lambda obj: outbox.put(("front_end", obj)), heartbeat_s=heartbeat_s,
                           on_error=lambda text: outbox.put(("front_end_lost", text)), name=f"deepinfer-node{member}")
        procs, inboxes = start()
        _relay(link, outbox, procs, inboxes, ranks, timeout_s, front_end)
    except BaseException:
        _stop(procs, inboxes, ranks, grace_s=1.0)  # failing: the ranks may be waiting on peers that are gone
        raise
    codes = _stop(procs, inboxes, ranks, grace_s=min(timeout_s, 30.0))
    link.send(("bye", codes))
    link.close_sending(min(timeout_s, 10.0))
    return 0 if all(code == 0 for code in codes.values()) else 1


def _relay(link: ControlLink, outbox, procs, inboxes, ranks: range, timeout_s: float, front_end: str) -> None:
    """Forward until the front-end says goodbye."""
    last_seen = time.monotonic()
    reported: set[int] = set()
    while True:
        try:
            msg = outbox.get(timeout=0.1)
        except queue_mod.Empty:
            msg = None
        if msg is not None and msg[0] == "front_end":
            last_seen = time.monotonic()
            obj = msg[1]
            if obj[0] == "bye":
                return
            if obj[0] == "refused":
                raise RuntimeError(f"{front_end} refused this node: {obj[1]}")
            if obj[0] == "rank":
                inboxes[obj[1] - ranks[0]].put(obj[2])
        elif msg is not None and msg[0] == "front_end_lost":
            raise RuntimeError(f"{describe_ranks(ranks)}: lost {front_end}: {msg[1]}")
        elif msg is not None:
            link.send(("from_rank", msg))
        for rank, proc in zip(ranks, procs):
            if proc.exitcode is not None and rank not in reported:
                reported.add(rank)
                link.send(("exit", rank, proc.exitcode))
        if time.monotonic() - last_seen > timeout_s:
            raise RuntimeError(f"{describe_ranks(ranks)}: {front_end} sent nothing for {timeout_s:.0f} s")


def _stop(procs, inboxes, ranks: range, grace_s: float) -> dict[int, int]:
    """Ask every live rank to stop, wait up to ``grace_s``, end the rest; the exit codes by rank."""
    for proc, inbox in zip(procs, inboxes):
        if proc.is_alive():
            inbox.put(("shutdown",))
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    return {rank: proc.exitcode for rank, proc in zip(ranks, procs)}


def serve_rank(config: EngineConfig, *, heartbeat_s: float = 1.0) -> int:
    """A torchrun process other than rank 0: serve its rank until rank 0's front-end shuts down (0 then)."""
    env = torchrun_config(config)
    if env.rank == 0:
        raise ValueError("RANK=0 runs the front-end: LLM(..., data_parallel_size=WORLD_SIZE)")
    store = rendezvous(env)
    outbox: queue_mod.Queue = queue_mod.Queue()

    def start() -> tuple[list, list]:
        rank = ThreadRank(config, env, store, outbox, heartbeat_s)
        return [rank], [rank.inbox]

    return serve_ranks(store, env.rank, env.world_size, start, outbox, range(env.rank, env.rank + 1),
                       config=config, timeout_s=env.timeout_s, heartbeat_s=heartbeat_s,
                       front_end=f"the front-end (RANK 0, {env.master_addr}:{env.master_port})")
