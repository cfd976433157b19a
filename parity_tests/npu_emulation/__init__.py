"""Contract emulation of ``torch_npu``: CPU implementations of exactly the torch_npu ops backends/ascend
calls.

What it proves: the Ascend backend calls each fused op with the documented argument order, layouts (BNSD / TND
/ paged BNSD keys), dtypes and returned tuples, and that the engine's tokens through backends/ascend equal the
CPU backend's when each op does what its documentation says. What it does not prove: anything about the
hardware, CANN's kernels, performance, or bf16 numerics on an NPU.

``install()`` puts a fake ``torch_npu`` module in ``sys.modules`` (and ``torch.npu``); ``uninstall()`` removes
both and forgets cached backends. Use the ``emulated_npu()`` context manager in tests. NPU graphs (capture, replay,
task-group updates) are emulated by recording and re-executing device work (:mod:`.graphs`); every op below is
graph-aware (one recorded task per call while capturing).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch

from . import graphs, ops_attention, ops_dense, ops_ep, ops_moe, ops_quant
from .contract import CALLS, ContractError
from .device import FakeNpuNamespace

__all__ = ["install", "uninstall", "emulated_npu", "CALLS", "ContractError"]

OPS = {
    "npu_rms_norm": ops_dense.npu_rms_norm,
    "npu_add_rms_norm": ops_dense.npu_add_rms_norm,
    "npu_swiglu": ops_dense.npu_swiglu,
    "npu_interleave_rope": ops_dense.npu_interleave_rope,
    "npu_rotary_mul": ops_dense.npu_rotary_mul,
    "npu_fused_infer_attention_score": ops_attention.npu_fused_infer_attention_score,
    "npu_moe_gating_top_k": ops_moe.npu_moe_gating_top_k,
    "npu_moe_init_routing_v2": ops_moe.npu_moe_init_routing_v2,
    "npu_grouped_matmul": ops_quant.npu_grouped_matmul,  # int8 calls there, floating-point ones in ops_moe
    "npu_moe_token_unpermute": ops_moe.npu_moe_token_unpermute,
    "npu_dynamic_quant": ops_quant.npu_dynamic_quant,
    "npu_quant_matmul": ops_quant.npu_quant_matmul,
    "npu_moe_distribute_dispatch": ops_ep.npu_moe_distribute_dispatch,
    "npu_moe_distribute_combine": ops_ep.npu_moe_distribute_combine,
    "_npu_fused_infer_attention_score_get_max_workspace":
        ops_attention.npu_fused_infer_attention_score_get_max_workspace,
}

#: Host-side calls: they size or allocate, no device kernel is captured for them.
HOST_SIDE = {"_npu_fused_infer_attention_score_get_max_workspace"}


def _reset_backend_caches() -> None:
    from deepinfer_npu.backends.ascend import runtime

    from deepinfer_npu.hal import registry

    runtime.reset()
    registry.clear_cache()


def install() -> types.ModuleType:
    if "torch_npu" in sys.modules and not getattr(sys.modules["torch_npu"], "__deepinfer_emulation__", False):
        raise RuntimeError("a real torch_npu is imported; refusing to shadow it with the emulation")
    mod = types.ModuleType("torch_npu")
    mod.__deepinfer_emulation__ = True
    mod.__version__ = "emulation"
    mod.npu_namespace = FakeNpuNamespace()
    for name, fn in OPS.items():
        setattr(mod, name, graphs.graph_aware(name, fn, device_task=name not in HOST_SIDE))
    # The ``.out`` overload of FIA (caller-owned outputs and workspace), as torch_npu exposes it.
    mod.npu_fused_infer_attention_score.out = graphs.graph_aware(
        "npu_fused_infer_attention_score.out", ops_attention.npu_fused_infer_attention_score_out
    )
    graphs.STATE.__init__()
    ops_ep.install_accessor()  # HCCL group names for the MC2 ops (ProcessGroupHCCL.get_hccl_comm_name)
    sys.modules["torch_npu"] = mod
    torch.npu = mod.npu_namespace  # type: ignore[attr-defined]
    CALLS.clear()
    _reset_backend_caches()
    return mod


def uninstall() -> None:
    graphs.STATE.__init__()
    ops_ep.uninstall_accessor()
    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu"):
        delattr(torch, "npu")
    _reset_backend_caches()


@contextlib.contextmanager
def emulated_npu() -> Iterator[types.ModuleType]:
    mod = install()
    try:
        yield mod
    finally:
        uninstall()
