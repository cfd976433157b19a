"""The torchrun form: one process per rank, started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` set), so the process IS the rank and no rank is spawned.

Every process reaches torchrun's rendezvous store (``env://``: torchrun's agent hosts it, or rank 0 when the
variables are set by hand); the ranks' groups and the control group share it under their own prefixes. Rank 0's
process runs the front-end (``LLM(...)`` / ``DPEngine``) with its rank's engine loop on a thread beside it; every
other process serves its rank headless (``node_server.serve_rank``) until rank 0 says goodbye, exactly as a node of
one rank does (``node_server.serve_ranks``).
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import threading

import torch.distributed as dist

from deepinfer_npu.config import EngineConfig

from .parallel_state import DistributedConfig
from .rank_worker import RankSpec, rank_main


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_config(config: EngineConfig) -> DistributedConfig:
    """torchrun's variables, checked against the engine's configuration (one process per rank)."""
    env = DistributedConfig.from_env(timeout_s=float(config.distributed_timeout_s))
    if config.data_parallel_size != env.world_size:
        raise ValueError(f"torchrun started WORLD_SIZE={env.world_size} processes, one per rank: set "
                         f"data_parallel_size={env.world_size} (got {config.data_parallel_size})")
    if config.nnodes != 1 or config.node_rank != 0 or config.master_addr or config.master_port:
        raise ValueError("under torchrun the nodes and the rendezvous are torchrun's (--nnodes, --node-rank, "
                         "--master-addr, --master-port go to torchrun): leave nnodes, node_rank, master_addr and "
                         "master_port unset here")
    return env


def rendezvous(env: DistributedConfig) -> dist.Store:
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=env.timeout_s)))
    except Exception as exc:
        raise RuntimeError(f"DP rank {env.rank}: could not reach torchrun's rendezvous at {env.master_addr}:"
                           f"{env.master_port} within {env.timeout_s:.0f} s: {exc}") from exc
    return store


class ThreadRank:
    """This process's rank, on a thread (what a spawned rank process is to the front-end)."""

    def __init__(self, config: EngineConfig, env: DistributedConfig, store: dist.Store, outbox,
                 heartbeat_s: float) -> None:
        spec = RankSpec(rank=env.rank, world_size=env.world_size, master_port=env.master_port, config=config,
                        heartbeat_s=heartbeat_s, timeout_s=env.timeout_s, master_addr=env.master_addr,
                        local_rank=env.local_rank)
        self.name, self.pid, self.exitcode = f"deepinfer-dp-rank{env.rank}", os.getpid(), None
        self.inbox: queue_mod.Queue = queue_mod.Queue()
        self._thread = threading.Thread(target=self._run, args=(spec, outbox, store), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, spec: RankSpec, outbox, store) -> None:
        try:
            rank_main(spec, self.inbox, outbox, store)
        finally:
            self.exitcode = 0  # failures travel as ("fatal", ...) messages, as from a rank process

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def terminate(self) -> None:
        """A thread cannot be ended from outside; it is a daemon and ends with the process."""
