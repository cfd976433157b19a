"""What carries expert-parallel traffic on a backend, for ``--list-ops``."""

from __future__ import annotations


def ep_dispatch_report(backend) -> dict[str, str]:
    """``{"ep_dispatch": ..., "ep_combine": ...}``: the path this backend's ranks take, and why not a faster one."""
    path = (f"torch.distributed all_to_all_single over {backend.dist_backend} (distributed/ep_comm.py; the host "
            "reads the split sizes: one sync per MoE layer and step)")
    if backend.name == "cuda":
        from deepinfer_npu.vendor import deep_ep

        status = deep_ep.probe()
        why = ("DeepEP found but not wired into the dispatch yet" if status.available
               else f"DeepEP not used: {status.reason}")
        path += f"; {why}"
    elif backend.name == "ascend":
        path += "; MC2 (npu_moe_distribute_dispatch / combine) not wired yet"
    return {"ep_dispatch": path, "ep_combine": path}
