"""What carries expert-parallel traffic on a backend, for ``--list-ops``."""

from __future__ import annotations

from .ep_decode_path import FixedCapacityAtDecode


def ep_dispatch_report(backend) -> dict[str, str]:
    """``{"ep_dispatch": ..., "ep_combine": ..., "eplb": ...}``: the path this backend's ranks take, and why not a
    faster one; where the load balancer's counts come from."""
    host_splits = "backends/cpu/ep_comm.py; the host reads the split sizes: one sync per MoE layer and step"
    kernels = getattr(backend, "kernels", None)
    if isinstance(kernels, FixedCapacityAtDecode):
        path = (f"fixed-capacity all_to_all_single on {backend.dist_backend} at decode sizes (no host sync; "
                "distributed/ep_fixed_capacity.py; for steps whose agreed token count, at most "
                f"{kernels.ep_fixed_max_tokens}, the engine declares with ep_decode_path.agreed_ep_tokens), variable "
                f"splits for prefill and undeclared steps ({host_splits})")
    else:
        path = (f"torch.distributed all_to_all_single over {backend.dist_backend} with variable splits (the kernel "
                f"set's ep_dispatch / ep_combine, {host_splits})")
    if backend.name == "cuda":
        from deepinfer_npu.vendor import deep_ep

        from deepinfer_npu.backends.cuda.ep_deepep import DEEPEP_WORLD_SIZES

        status = deep_ep.probe()
        if status.available:
            path = (f"DeepEP's normal kernels (version {status.version or 'unknown'}) for prefill and undeclared "
                    f"steps in bf16 at EP world sizes {DEEPEP_WORLD_SIZES} (backends/cuda/ep_deepep.py; DeepEP "
                    f"returns its receive counts to the host); otherwise: {path}")
        else:
            path += f"; DeepEP not used: {status.reason}"
    elif backend.name == "ascend" and hasattr(kernels, "ep_path_report"):
        mc2 = kernels.ep_path_report()
        return {"ep_dispatch": f"{mc2['ep_dispatch']}; otherwise: {path}",
                "ep_combine": f"{mc2['ep_combine']}; otherwise: {path}", "eplb": _eplb(backend)}
    return {"ep_dispatch": path, "ep_combine": path, "eplb": _eplb(backend)}


def _eplb(backend) -> str:
    counts = {"cpu": "torch.bincount in the reference moe_dispatch",
              "cuda": "the kernels_cuda.moe_routing permute kernel's counts (composed torch scatter_add_ past its "
                      "limits)",
              "ascend": "npu_moe_distribute_dispatch's expert_token_nums under MC2, else npu_moe_init_routing_v2's "
                        "expert_token_count (expert_tokens_num_type=1)"}.get(
        backend.name, "the backend's moe_dispatch counts")
    return (f"per-slot token counts from the local dispatch op ({counts}), added on the device with one torch add "
            "per layer and step, read at re-plan time; weights move over the device group with all_to_all_single "
            f"on {backend.dist_backend} (deepinfer_npu/eplb)")
