"""MoE routing: ``moe_gating_topk``, ``moe_dispatch``, ``moe_combine`` (and the composites ``moe_route``,
``moe_combine_add``) on ``kernels_cuda.moe_routing``: warp gating top-k with torch's tie and summation order, a
counting-sort permute that can also write the expert GEMMs' scan, the gating fused with that permute at decode
sizes, and an fp32 weighted un-permute that can add the shared experts' output. Else composed torch, sync-free."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_npu.hal.types import DispatchState, GatingParams, KernelWarmupPlan

from .base import NOT_ON_DEVICE, OpImpl, kernel_module, meta, ref


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype for expert ids in [0, num_experts]: the bound itself included (a sink slot)."""
    if num_experts <= torch.iinfo(torch.uint8).max:
        return torch.uint8
    if num_experts <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32 if num_experts <= torch.iinfo(torch.int32).max else torch.int64


class MoERouting(OpImpl):
    KERNELS = ("moe_routing", "moe_route", "moe_dispatch_scan", "moe_combine_add")
    PRIMARY = {"moe_gating_topk": "moe_routing", "moe_dispatch": "moe_routing", "moe_combine": "moe_routing"}
    PLANNED = {
        "moe_gating_topk": "kernels_cuda.moe_routing gating (one kernel) for E % 32 == 0, E <= 256, k <= 16; "
        "else the reference (softmax/sigmoid + topk, sync-free)",
        "moe_dispatch": "kernels_cuda.moe_routing permute (counting sort, one kernel) for bf16 / fp32 with T*k <= "
        "8192; else composed torch (stable argsort + scatter_add); sync-free",
        "moe_combine": "kernels_cuda.moe_routing unpermute (one kernel) for bf16 / fp32, above T*k = 8192 after a "
        "scatter inverting the order; else composed torch (index_copy_ + weighted sum); sync-free",
    }
    FALLBACK = {"moe_gating_topk": "reference op on CUDA tensors (softmax/sigmoid + topk) where "
                "kernels_cuda.moe_routing does not apply; sync-free"}
    SYNCING = {"moe_dispatch": "torch.bincount (CUDA computes max() on the host)"}

    def _module(self, x: torch.Tensor) -> tuple[ModuleType | None, str | None]:
        return (None, NOT_ON_DEVICE) if not x.is_cuda else self.use("moe_routing")

    def moe_gating_topk(self, router_logits, bias, params: GatingParams):
        mod, why = self._module(router_logits)
        if mod is not None:
            why = mod.gating_reason(router_logits, bias, params)
        if why is not None:
            self.note("moe_gating_topk", f"reference ({why})", False)
            return ref("moe").moe_gating_topk(router_logits, bias, params)
        self.note("moe_gating_topk", f"kernels_cuda.moe_routing gating ({params.scoring_func}/{params.topk_method}, "
                  f"E={params.num_experts}, k={params.top_k})", True)
        return mod.gating_topk(router_logits, bias, params)

    def moe_route(self, router_logits, bias, params: GatingParams, hidden, num_experts: int):
        """Decode sizes (T <= the kernel's MAX_ROUTE_TOKENS): the gating top-k and the permute (with the expert
        GEMMs' scan) in one launch, bit-identical to the two kernels; else ``moe_gating_topk``, ``moe_dispatch``."""
        mod = self.use("moe_route")[0] if hidden.is_cuda else None
        if mod is None or not hasattr(mod, "route") or mod.route_reason(router_logits, bias, params, hidden,
                                                                        num_experts) is not None:
            ks = self.ks
            weights, ids = ks.moe_gating_topk(router_logits, bias, params)
            sorted_hidden, tokens_per_expert, state = ks.moe_dispatch(hidden, ids, num_experts)
            return weights, ids, sorted_hidden, tokens_per_expert, state
        path = (f"kernels_cuda.moe_routing route (gating + permute + scan in one launch, {params.scoring_func}/"
                f"{params.topk_method}, E={num_experts}, k={params.top_k})")
        self.note("moe_gating_topk", path, True)
        self.note("moe_dispatch", path, True)
        weights, ids, sorted_hidden, counts, order, scan = mod.route(router_logits, bias, params, hidden, num_experts)
        self.ks.dispatch_scan = (counts, scan)  # for grouped_mlp, which receives these counts next (identity-checked)
        return weights, ids, sorted_hidden, counts, DispatchState(order=order, num_tokens=ids.shape[0],
                                                                  top_k=ids.shape[1])

    def moe_dispatch(self, hidden, ids, num_experts: int):
        """The permute kernel (counting sort by expert = the reference's stable argsort) for bf16 / fp32 with
        T*k <= its MAX_ASSIGN; else the stable sort with counts by ``scatter_add_`` (CUDA ``bincount`` syncs)."""
        mod, why = self._module(hidden)
        if mod is not None:
            why = mod.permute_reason(hidden, ids, num_experts)
        if why is None:
            self.note("moe_dispatch", f"kernels_cuda.moe_routing permute ({str(hidden.dtype).removeprefix('torch.')}, "
                      f"k={ids.shape[1]}, E={num_experts}), sync-free", True)
            if "moe_dispatch_scan" not in self.off and num_experts <= mod.MAX_SCAN_EXPERTS:
                # the expert GEMMs' scan from the same launch (no expert_scan kernel): kept for grouped_mlp,
                # which receives these counts next (identity-checked there)
                sorted_hidden, counts, order, scan = mod.permute(hidden, ids, num_experts, with_scan=True)
                self.ks.dispatch_scan = (counts, scan)
            else:
                sorted_hidden, counts, order = mod.permute(hidden, ids, num_experts)
            return sorted_hidden, counts, DispatchState(order=order, num_tokens=ids.shape[0], top_k=ids.shape[1])
        self.note("moe_dispatch", f"composed torch (stable argsort + scatter_add counts), sync-free ({why})", True)
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1).long()
        # the narrowest key that holds every expert id: CUB's radix sort makes one pass per 8 key bits (8 on int64
        # keys, 1 on uint8), and a stable sort of the same values gives the same order in any key dtype
        order = torch.argsort(flat_ids.to(sort_key_dtype(num_experts)), stable=True)
        sorted_hidden = hidden.index_select(0, order // top_k)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        return sorted_hidden, counts, DispatchState(order=order, num_tokens=num_tokens, top_k=top_k)

    def _unpermute_form(self, mod, expert_out, state: DispatchState, weights) -> tuple[bool, str | None]:
        """(by_position, why not): the kernel that scans the order (decode sizes), else the one that reads its
        inverse (one scatter computes it: prefill sizes, T*k > MAX_ASSIGN), else why neither applies."""
        args = (expert_out, state.order, weights, state.num_tokens, state.top_k)
        why = mod.unpermute_reason(*args)
        if why is None or state.order.numel() <= mod.MAX_ASSIGN:
            return False, why
        return True, mod.unpermute_reason(*args, by_position=True)

    def moe_combine(self, expert_out, state: DispatchState, weights):
        """The un-permute and the fp32 weighted sum in torch's summation order in one kernel (at prefill sizes
        after a scatter inverting the order); else the reference's arithmetic with ``index_copy_`` for the
        un-permute. Both sync-free."""
        mod, why = self._module(expert_out)
        by_position = False
        if mod is not None:
            by_position, why = self._unpermute_form(mod, expert_out, state, weights)
        if why is None:
            dtype = str(expert_out.dtype).removeprefix("torch.")
            form = ", by position" if by_position else ""
            self.note("moe_combine", f"kernels_cuda.moe_routing unpermute ({dtype}, k={state.top_k}{form}), sync-free",
                      True)
            return mod.unpermute(expert_out, state.order, weights, state.num_tokens, state.top_k,
                                 by_position=by_position)
        self.note("moe_combine", f"composed torch (index_copy_ + weighted sum in fp32), sync-free ({why})", True)
        unsorted = torch.empty_like(expert_out, dtype=torch.float32)
        unsorted.index_copy_(0, state.order, expert_out.float())
        per_token = unsorted.view(state.num_tokens, state.top_k, expert_out.shape[-1])  # also for 0 tokens
        return (per_token * weights.float().unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)

    def moe_combine_add(self, expert_out, state: DispatchState, weights, addend):
        """The un-permute with the addend fused (the shared experts' output: one launch instead of the combine and
        an add; the same roundings) where the plain combine kernel applies; else the combine, then torch's add."""
        mod = self.use("moe_combine_add")[0] if expert_out.is_cuda else None
        by_position, why = self._unpermute_form(mod, expert_out, state, weights) if mod is not None else (False, "")
        if why is None and mod.addend_reason(expert_out, addend, state.num_tokens) is None:
            form = ", by position" if by_position else ""
            self.note("moe_combine", f"kernels_cuda.moe_routing unpermute + addend ({str(expert_out.dtype)[6:]}, "
                      f"k={state.top_k}{form}), sync-free", True)
            return mod.unpermute(expert_out, state.order, weights, state.num_tokens, state.top_k, addend=addend,
                                 by_position=by_position)
        return self.ks.moe_combine(expert_out, state, weights) + addend

    # ---- warm-up -------------------------------------------------------------------------------------------
    def warmup_configs(self, plan: KernelWarmupPlan, num_sms: int) -> dict[str, list[tuple]]:
        """``(kind, cfg)`` of gating, permute and unpermute, each where its ``*_reason`` accepts a one-token step;
        the permute that writes the scan too, the gating fused with it (one-token steps, which every plan reaches,
        are within its MAX_ROUTE_TOKENS) and the un-permute with the addend, where selected."""
        g = plan.moe_gating
        if g is None or not self.wants("moe_routing"):
            return {}
        mr = kernel_module("moe_routing")
        items = []
        # The router's correction bias (noaux_tc) is a CUDA tensor at run time; the check here is on the shapes.
        if mr.gating_reason(meta(1, g.num_experts, dtype=torch.float32), None, g) is None:
            items.append(("gating", mr._gating_cfg(g, "torch_last", True)))  # the launch's own key
        dt = mr.DTYPES.get(plan.dtype)
        k, d = g.top_k, plan.hidden_size
        if dt is not None and mr.permute_reason(meta(1, d, dtype=plan.dtype), meta(1, k, dtype=torch.int32),
                                                g.num_experts) is None:
            items.append(("permute", (d, k, g.num_experts, dt)))
            if self.wants("moe_dispatch_scan") and g.num_experts <= mr.MAX_SCAN_EXPERTS:
                items.append(("permute", (d, k, g.num_experts, dt, 128, True)))
            if self.wants("moe_route") and items[0][0] == "gating" and g.num_experts <= mr.MAX_SCAN_EXPERTS:
                items.append(("route", mr._route_cfg(g, d, dt, True)))  # the launch's own key (bias as for gating)
        if dt is not None and mr.unpermute_reason(meta(k, d, dtype=plan.dtype), meta(k),
                                                  meta(1, k, dtype=torch.float32), 1, k) is None:
            items.append(("unpermute", mr.unpermute_cfg(d, k, dt)))
            if self.wants("moe_combine_add"):
                items.append(("unpermute", mr.unpermute_cfg(d, k, dt, with_addend=True)))
            if plan.max_num_batched_tokens * k > mr.MAX_ASSIGN:  # prefill steps: the kernel reading the inverse
                items.append(("unpermute", mr.unpermute_cfg(d, k, dt, with_addend=self.wants("moe_combine_add"),
                                                            by_position=True)))
        return {"moe_routing": items}
