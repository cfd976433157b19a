"""Process groups of a data-parallel + expert-parallel deployment: one process per rank, one device per process.

Two groups over the same ranks (DeepInfer's layout):

- the **device group**, on the backend's collective library (``Backend.dist_backend``: gloo on CPU, nccl, hccl),
  carries the expert-parallel dispatch / combine traffic;
- the **CPU group** (gloo) carries the step-kind vote and control messages, so agreeing on a step never waits
  on the device (under zero-overhead scheduling the host plans step N+1 while the device runs step N).

Rank, world size and the rendezvous follow torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); every collective has a timeout so a dead or stuck rank ends the others with an
error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from .ep_moe import EPGroup

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MASTER_PORT = 29500  # torchrun's

# This process's expert-parallel group, read by the MoE layers when the model is built (as vLLM's parallel state):
# None = every routed expert lives here.
_EXPERT_PARALLEL: EPGroup | None = None


def set_expert_parallel(ep: EPGroup | None) -> None:
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = ep


def get_expert_parallel() -> EPGroup | None:
    return _EXPERT_PARALLEL


@dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in the deployment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, world_size={self.world_size})")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def from_env(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistributedConfig:
        """torchrun's variables; a missing or malformed one is named in the error."""

        def read(name: str, default: str | None = None) -> str:
            value = os.environ.get(name, default)
            if value is None:
                raise ValueError(f"{name} is not set (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                                 "MASTER_PORT)")
            return value

        def read_int(name: str, default: str | None = None) -> int:
            raw = read(name, default)
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None

        return cls(rank=read_int("RANK"), world_size=read_int("WORLD_SIZE"),
                   local_rank=read_int("LOCAL_RANK", "0"), master_addr=read("MASTER_ADDR", "127.0.0.1"),
                   master_port=read_int("MASTER_PORT", str(DEFAULT_MASTER_PORT)), timeout_s=timeout_s)


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank talks over. ``cpu_group`` is gloo; ``device_group`` is on the device's library."""

    rank: int
    world_size: int
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup
    timeout_s: float


def init_process_groups(cfg: DistributedConfig, dist_backend: str = "gloo",
                        store: dist.Store | None = None) -> ParallelGroups:
    """Join the deployment: the default (device) group on ``dist_backend`` and a gloo CPU group beside it.
    ``store``: rendezvous on this store (a multi-node deployment shares node 0's) instead of ``tcp://addr:port``."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    where = {"store": store} if store is not None else {"init_method": f"tcp://{cfg.master_addr}:{cfg.master_port}"}
    try:
        dist.init_process_group(backend=dist_backend, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout,
                                **where)
    except Exception as exc:  # the rendezvous' own errors do not say which rank or address was involved
        raise RuntimeError(f"rank {cfg.rank}/{cfg.world_size}: could not join the process group at "
                           f"{cfg.master_addr}:{cfg.master_port} on {dist_backend} within {cfg.timeout_s:.0f} s: "
                           f"{exc}") from exc
    device_group = dist.group.WORLD
    cpu_group = device_group if dist_backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelGroups(rank=cfg.rank, world_size=cfg.world_size, cpu_group=cpu_group,
                          device_group=device_group, timeout_s=cfg.timeout_s)


def destroy_process_groups() -> None:
    set_expert_parallel(None)
    if dist.is_initialized():
        dist.destroy_process_group()
