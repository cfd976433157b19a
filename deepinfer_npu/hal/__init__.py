"""Hardware abstraction: the Backend base class, the KernelSet op contract, and the backend registry."""

from .backend import Backend, MemoryInfo
from .graph_runner import EagerReplayRunner, GraphRunner
from .kernel_set import KernelSet
from .registry import get_backend, register_backend, registered_backends
from .sync_guard import SyncForbiddenError, check_sync_allowed, sync_forbidden
from .types import DispatchState, GatingParams, KernelWarmupPlan, MLAWeights, RopeLike

__all__ = [
    "Backend",
    "DispatchState",
    "EagerReplayRunner",
    "GatingParams",
    "GraphRunner",
    "KernelSet",
    "KernelWarmupPlan",
    "MLAWeights",
    "MemoryInfo",
    "RopeLike",
    "SyncForbiddenError",
    "check_sync_allowed",
    "get_backend",
    "register_backend",
    "registered_backends",
    "sync_forbidden",
]
