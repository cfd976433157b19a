"""What every CUDA op implementation shares: the kernel modules (imported once, with the reason when one cannot be),
the record of the paths the ops took (for ``op_report`` and the sync guard), and the configuration the
implementations are chosen for at start-up.

An implementation (:class:`OpImpl`) serves one op family. It answers three questions over the same object:
whether it applies to the model and engine (:meth:`OpImpl.select`, once, with the reason when not), which kernel
configurations the engine can reach (:meth:`OpImpl.warmup_configs`, compiled at start-up), and the call itself,
whose remaining checks read only host-known shapes of the step, never device values.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from deepinfer_npu.hal.types import KernelWarmupPlan

logger = logging.getLogger("deepinfer_npu.backends.cuda")

BF16 = torch.bfloat16
NOT_ON_DEVICE = "tensor not on a CUDA device"


def ref(module: str) -> ModuleType:
    """The CPU reference op module ``deepinfer_npu.backends.cpu.<module>`` (the oracle; also the fallback)."""
    return importlib.import_module(f"deepinfer_npu.backends.cpu.{module}")


def kernel_module(name: str) -> ModuleType:
    """``deepinfer_npu.kernels_cuda.<name>`` for its host-side functions (importable without tilelang)."""
    return importlib.import_module(f"deepinfer_npu.kernels_cuda.{name}")


def tilelang_importable() -> bool:
    """Whether ``tilelang`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec("tilelang") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def is_sm90(device_index: int) -> bool:
    """Hopper (compute capability 9.x): where the sm_90a-only kernels (wgmma issued by hand, setmaxnreg warpgroup
    roles: ``mla_decode_ws``) may run."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def current_device_is_sm90() -> bool:
    return torch.cuda.is_available() and is_sm90(torch.cuda.current_device())


def meta(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of ``shape`` without storage, for the kernel modules' host-fact ``reason`` checks."""
    return torch.empty(shape, dtype=dtype, device="meta")


@contextlib.contextmanager
def known_syncing_fallback():
    """Run a reported, knowingly syncing reference fallback (e.g. prefill attention on toy dims) with torch's sync
    debug mode lowered from "error" to "warn": the op report already names it; the guard stays armed for the
    rest of the launch path. (The mode is "error" when every op seen so far was sync-free, e.g. right after
    capturing decode graphs at start-up, before the first prefill.)"""
    previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if previous == 2:
        torch.cuda.set_sync_debug_mode(1)
    try:
        yield
    finally:
        if previous == 2:
            torch.cuda.set_sync_debug_mode(previous)


class KernelModules:
    """The ``kernels_cuda`` modules of one kernel set: each imported at most once (at start-up or its first use);
    ``None`` with the reason kept when tilelang or the module does not import, or its warm-up compile failed."""

    def __init__(self) -> None:
        self.loaded: dict[str, ModuleType | None] = {}
        self.errors: dict[str, str] = {}

    def get(self, name: str) -> Any:
        if name in self.loaded:
            return self.loaded[name]
        mod = None
        if not tilelang_importable():
            self.errors[name] = "tilelang is not installed (pip install tilelang==0.1.15)"
        else:
            try:
                mod = kernel_module(name)
                if getattr(mod, "tilelang", None) is None:
                    self.errors[name] = "tilelang failed to import"
                    mod = None
            except Exception as e:  # noqa: BLE001 - any import failure means: use the reference
                self.errors[name] = f"kernels_cuda.{name} failed to import: {type(e).__name__}: {e}"
                mod = None
        self.loaded[name] = mod
        return mod

    def error(self, name: str) -> str:
        return self.errors[name]

    def disable(self, name: str, why: str) -> None:
        """Turn ``name`` off for good (its ops take their fallback with ``why``)."""
        self.loaded[name] = None
        self.errors[name] = why


class PathLog:
    """op -> {path description: (native?, syncs?)}, filled as ops are called; the syncing paths kept apart, since
    every step asks for them (``forbid_sync`` arms the sync debug mode from them)."""

    def __init__(self) -> None:
        self.paths: dict[str, dict[str, tuple[bool, bool]]] = {}
        self._syncing: dict[str, list[str]] = {}
        self.calls = 0

    def note(self, op: str, path: str, native: bool, syncs: bool = False) -> None:
        self.calls += 1
        d = self.paths.setdefault(op, {})
        if path not in d:
            d[path] = (native, syncs)
            if syncs:
                self._syncing.setdefault(op, []).append(path)
                logger.info("cuda backend: %s takes a syncing path: %s", op, path)

    def syncing_ops(self) -> dict[str, list[str]]:
        return {op: list(paths) for op, paths in self._syncing.items()}

    def clear(self) -> None:
        """Forget the paths taken so far (the call count stays: the model has run)."""
        self.paths.clear()
        self._syncing.clear()


@dataclass(frozen=True)
class OpConfig:
    """What the implementations are chosen for: the model's facts that are the same at every call (None: not known
    yet, decided at each call instead), whether the device is a Hopper, and implementations left out by name
    (tests that compare a kernel with the path it replaces)."""

    dtype: torch.dtype | None = None
    num_heads: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    kv_lora_rank: int | None = None
    block_size: int | None = None
    sm90: bool = False
    skip: frozenset[str] = field(default_factory=frozenset)

    @property
    def known(self) -> bool:
        return self.dtype is not None

    @classmethod
    def from_plan(cls, plan: KernelWarmupPlan, sm90: bool, skip: frozenset[str] = frozenset()) -> OpConfig:
        return cls(plan.dtype, plan.num_heads, plan.qk_nope_head_dim, plan.qk_rope_head_dim, plan.kv_lora_rank,
                   plan.block_size, sm90, skip)

    @classmethod
    def from_model(cls, model_config: Any, dtype: torch.dtype, block_size: int, sm90: bool,
                   skip: frozenset[str] = frozenset()) -> OpConfig:
        mc = model_config
        return cls(dtype, mc.num_attention_heads, mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.kv_lora_rank,
                   block_size, sm90, skip)


class OpImpl:
    """One op family's implementation on the CUDA backend (module docstring).

    ``KERNELS``: the ``kernels_cuda`` modules (or variants, e.g. ``mla_prefill``) it may launch; ``PRIMARY``: op ->
    the kernel whose absence makes that op a fallback; ``PLANNED``: op -> what the family runs, shown before the
    first call; ``FALLBACK``: op -> the fallback's description; ``SYNCING``: op -> what its syncing reference reads
    on the host.
    """

    KERNELS: tuple[str, ...] = ()
    PRIMARY: dict[str, str] = {}
    PLANNED: dict[str, str] = {}
    FALLBACK: dict[str, str] = {}
    SYNCING: dict[str, str] = {}

    def __init__(self, ks: Any) -> None:
        self.ks = ks  # the CudaKernelSet: its modules, its path log, its other ops
        self.refused: dict[str, str] = {}  # kernel -> why it cannot serve the configuration (selection)
        self.off: dict[str, str] = {}  # the refused ones and those whose module does not import

    @property
    def modules(self) -> KernelModules:
        return self.ks.modules

    def note(self, op: str, path: str, native: bool, syncs: bool = False) -> None:
        self.ks.log.note(op, path, native, syncs)

    def select(self, cfg: OpConfig) -> None:
        """Decide, once, which of :attr:`KERNELS` serve ``cfg``: a kernel left out by ``cfg.skip`` or refused by
        :meth:`refuses` is off with the reason; with the model known its module is imported now (a failure is a
        reason too, which the warm-up reports as skipped)."""
        self.refused, self.off = {}, {}
        for name in self.KERNELS:
            why = f"kernels_cuda.{name} left out of the selection" if name in cfg.skip else self.refuses(name, cfg)
            if why is not None:
                self.refused[name] = why
            else:
                module = KERNEL_MODULE.get(name, name)
                if cfg.known and self.modules.get(module) is None:
                    why = self.modules.error(module)
            if why is not None:
                self.off[name] = why

    def wants(self, name: str) -> bool:
        """Whether kernel ``name`` serves the selected configuration (its module's import aside)."""
        return name not in self.refused

    def refuses(self, name: str, cfg: OpConfig) -> str | None:
        """Why kernel ``name`` cannot serve ``cfg`` (dtype, dims, heads, device), or None."""
        return None

    def use(self, name: str) -> tuple[Any, str | None]:
        """At a call: ``(kernels_cuda module, None)`` when kernel ``name`` was selected and its module imports
        (imported at first use when no plan was given), else ``(None, why)``."""
        why = self.off.get(name)
        if why is not None:
            return None, why
        module = KERNEL_MODULE.get(name, name)
        mod = self.modules.get(module)
        return (mod, None) if mod is not None else (None, self.modules.error(module))

    def checked(self, name: str, x: torch.Tensor, *reason_args: Any) -> tuple[Any, str | None]:
        """``(module, None)`` when kernel ``name`` may run on ``x`` and the module's ``reason(*reason_args)``
        accepts the call (no arguments: no check), else ``(None, "reference (why)")``."""
        if not x.is_cuda:
            return None, f"reference ({NOT_ON_DEVICE})"
        mod, why = self.use(name)
        if mod is None:
            return None, f"reference ({why})"
        if reason_args and (why := mod.reason(*reason_args)) is not None:
            return None, f"reference ({why})"
        return mod, None

    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``{kernels_cuda module: [config, ...]}`` this family reaches for ``plan`` (selected for it), in the form
        the module's ``precompile`` takes them; only kernels it :meth:`wants`."""
        return {}


#: kernel variants that live in another module: variant -> module
KERNEL_MODULE = {"mla_prefill": "mla_decode", "mla_decode_ws": "mla_decode", "moe_route": "moe_routing",
                 "moe_dispatch_scan": "moe_routing", "moe_combine_add": "moe_routing"}


def step_token_bounds(plan: KernelWarmupPlan) -> tuple[int, int]:
    """(fewest, most) tokens of a step: 1 .. max_num_batched_tokens (graph sizes never exceed it)."""
    return 1, max([plan.max_num_batched_tokens, *plan.decode_graph_sizes])
