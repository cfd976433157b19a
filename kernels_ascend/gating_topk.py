"""DeepSeek MoE gating top-k for configurations outside ``torch_npu.npu_moe_gating_top_k``'s documented limits
(backends/ascend/capabilities.py ``decide_gating``: expert counts other than 256 on A2/A3 or above 2048 on 950,
``topk_group != 4`` on A2/A3, no correction bias, no renormalisation, ``group_limited_greedy``, softmax
with ``noaux_tc``, ``top_k > 32``).

Contract: backends/cpu/moe.py ``moe_gating_topk`` — router logits [T, E] fp32 (+ bias [E]) -> weights [T, k] fp32,
ids [T, k] int32; the order of the k choices is unspecified (docs/interfaces.md). One block per token, scalar code
on the vector core with the token's scores in the Unified Buffer (``alloc_shared``):

1. scores ``s``: softmax (max, ``exp(x - max)`` summed in index order, times ``1 / sum`` as torch's CPU kernel) or
   sigmoid ``1 / (1 + exp(-x))``;
2. selection values ``c``: ``s`` (+ the correction bias for ``noaux_tc``); with groups (``group_limited_greedy``:
   a group's max score; ``noaux_tc``: the sum of its two largest biased scores) the ``topk_group`` best groups are
   kept by counting ranks (ties to the lower group) and the other experts get ``0.0`` (group_limited_greedy) or
   ``-inf`` (noaux_tc), as the reference's ``masked_fill``;
3. top-k: ``k`` rounds, each taking the largest ``c`` below the previous pick in the order (value descending, index
   ascending; NaN above +inf as in torch.topk), so ties go to the lower expert id (the reference's
   ``torch.topk(sorted=False)`` picks among exact ties in an unspecified way); picks come out in that order;
4. weights: ``c`` of the pick (greedy / group_limited_greedy) or its unbiased score (noaux_tc), then
   ``w / (sum(w) + 1e-20)`` when ``norm_topk_prob`` (summed in pick order) and ``* routed_scaling_factor``.

Scores, group scores and sums may differ from torch's in the last ulps (vectorised sums, the device's ``exp``), so
weights are compared within an fp32 tolerance; ids are identical unless two candidates tie within those ulps.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, exact_f32, lower_ascend

MAX_EXPERTS = 8192  # two fp32 [E] buffers per block in the Unified Buffer (64 KiB at the maximum)
METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")


# The top-k order: NaN above +inf (as torch.topk), so every round finds a pick and ids stay valid.
def _gt(a, b):
    return T.Or(a > b, T.And(T.isnan(a), T.Not(T.isnan(b))))


def _eq(a, b):
    return T.Or(a == b, T.And(T.isnan(a), T.isnan(b)))


def unsupported(num_experts: int, top_k: int, scoring_func: str, topk_method: str, n_group: int,
                topk_group: int) -> str | None:
    """Why :func:`build` does not take a configuration (None when it does): the caller then runs the reference."""
    if scoring_func not in SCORINGS:
        return f"scoring_func {scoring_func!r}"
    if topk_method not in METHODS:
        return f"topk_method {topk_method!r}"
    if not 1 <= num_experts <= MAX_EXPERTS:
        return f"{num_experts} experts (kernel takes 1..{MAX_EXPERTS})"
    if not 1 <= top_k <= num_experts:
        return f"top_k {top_k} of {num_experts} experts"
    if topk_method != "greedy":
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            return f"n_group {n_group} / topk_group {topk_group} with {num_experts} experts"
        if topk_method == "noaux_tc" and num_experts // n_group < 2:
            return "noaux_tc with fewer than 2 experts per group"
        if top_k > topk_group * (num_experts // n_group):
            return f"top_k {top_k} exceeds the {topk_group * (num_experts // n_group)} experts of the kept groups"
    return None


def build(num_experts: int, top_k: int, scoring_func: str = "softmax", topk_method: str = "greedy",
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0,
          has_bias: bool = False):
    """PrimFunc (logits [T, E] f32, bias [E] f32, weights [T, k] f32 out, ids [T, k] i32 out); T dynamic. The bias
    is read only for ``noaux_tc`` with ``has_bias`` (pass any [E] fp32 tensor otherwise)."""
    why = unsupported(num_experts, top_k, scoring_func, topk_method, n_group, topk_group)
    assert why is None, why
    E, K = num_experts, top_k
    grouped = topk_method != "greedy"
    G = n_group if grouped else 1
    TG = topk_group if grouped else 1
    PG = E // G
    softmax, noaux = scoring_func == "softmax", topk_method == "noaux_tc"
    biased = noaux and has_bias
    M = T.dynamic("M")
    f32, i32 = "float32", "int32"
    ninf = -float("inf")

    @T.prim_func
    def gating_topk(
        logits: T.Tensor([M, E], f32),
        bias: T.Tensor([E], f32),
        weights: T.Tensor([M, K], f32),
        ids: T.Tensor([M, K], i32),
    ):
        with T.Kernel(M) as bx:
            sc = T.alloc_shared([2 * E], f32)  # scores s = sc[:E], selection values c = sc[E:] (one UB buffer)
            gs = T.alloc_local([G], f32)  # group scores
            gk = T.alloc_local([G], i32)  # group kept
            wk = T.alloc_local([K], f32)  # picked weights
            mx = T.alloc_var(f32)
            tot = T.alloc_var(f32)
            v1 = T.alloc_var(f32)
            v2 = T.alloc_var(f32)
            rank = T.alloc_var(i32)
            pv = T.alloc_var(f32)
            pi = T.alloc_var(i32)
            bv = T.alloc_var(f32)
            bi = T.alloc_var(i32)
            # 1. scores
            if softmax:
                mx = logits[bx, 0]
                for e in T.serial(E):
                    mx = T.max(mx, logits[bx, e])
                tot = T.float32(0.0)
                for e in T.serial(E):
                    sc[e] = T.exp(logits[bx, e] - mx)
                    tot = tot + sc[e]
                tot = T.float32(1.0) / tot
                for e in T.serial(E):
                    sc[e] = sc[e] * tot
            else:
                for e in T.serial(E):
                    sc[e] = T.float32(1.0) / (T.float32(1.0) + T.exp(-logits[bx, e]))
            # 2. selection values, group-limited
            for e in T.serial(E):
                if biased:
                    sc[E + e] = sc[e] + bias[e]
                else:
                    sc[E + e] = sc[e]
            if grouped:
                for g in T.serial(G):
                    v1 = T.float32(ninf)
                    v2 = T.float32(ninf)
                    for j in T.serial(PG):
                        if sc[E + g * PG + j] > v1:
                            v2 = v1
                            v1 = sc[E + g * PG + j]
                        elif sc[E + g * PG + j] > v2:
                            v2 = sc[E + g * PG + j]
                    if noaux:
                        gs[g] = v1 + v2
                    else:
                        gs[g] = v1
                for g in T.serial(G):
                    rank = 0
                    for h in T.serial(G):
                        if gs[h] > gs[g] or (gs[h] == gs[g] and h < g):
                            rank = rank + 1
                    gk[g] = T.if_then_else(rank < TG, 1, 0)
                for e in T.serial(E):
                    if gk[e // PG] == 0:
                        if noaux:
                            sc[E + e] = T.float32(ninf)
                        else:
                            sc[E + e] = T.float32(0.0)
            # 3. top-k: the largest c below the previous pick in (value desc, index asc) order, k times
            pv = T.float32(0.0)
            pi = -1
            tot = T.float32(0.0)
            for r in T.serial(K):
                bv = T.float32(0.0)
                bi = -1
                for e in T.serial(E):
                    if r == 0 or _gt(pv, sc[E + e]) or (_eq(sc[E + e], pv) and e > pi):
                        if bi < 0 or _gt(sc[E + e], bv):
                            bv = sc[E + e]
                            bi = e
                pv = bv
                pi = bi
                ids[bx, r] = bi
                # 4. weights
                if noaux:
                    wk[r] = sc[bi]
                else:
                    wk[r] = bv
                tot = tot + wk[r]
            for r in T.serial(K):
                if norm_topk_prob:
                    weights[bx, r] = wk[r] / (tot + exact_f32(1e-20)) * exact_f32(routed_scaling_factor)
                else:
                    weights[bx, r] = wk[r] * exact_f32(routed_scaling_factor)

    return gating_topk


def reference(logits, bias, num_experts, top_k, scoring_func="softmax", topk_method="greedy", n_group=1,
              topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0):
    """backends/cpu/moe.py: moe_gating_topk."""
    from deepinfer_npu.backends.cpu.moe import moe_gating_topk

    from deepinfer_npu.hal.types import GatingParams

    params = GatingParams(top_k=top_k, num_experts=num_experts, scoring_func=scoring_func, topk_method=topk_method,
                          n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor)
    return moe_gating_topk(logits, bias, params)


def by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's choices sorted by expert id (the op's choice order is unspecified)."""
    ids_sorted, order = torch.sort(ids.long(), dim=-1)
    return weights.gather(1, order), ids_sorted


#: Configurations outside npu_moe_gating_top_k's limits (and V3 itself), checked on the host C build.
CASES = (
    # (E, k, scoring, method, n_group, topk_group, norm, rsf, bias)
    (384, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, True),  # > 256 experts (A2/A3), Kimi-K2-like
    (256, 8, "sigmoid", "noaux_tc", 8, 3, True, 2.5, True),  # topk_group 3 (A2/A3 takes 4)
    (3072, 8, "sigmoid", "noaux_tc", 16, 4, True, 1.0, True),  # > 2048 experts (950)
    (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0, False),  # V2: no renormalisation
    (64, 6, "softmax", "greedy", 1, 1, False, 1.0, False),  # V2-Lite
    (72, 40, "sigmoid", "greedy", 1, 1, True, 1.0, False),  # top_k > 32
    (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, False),  # no bias
)
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-7  # fp32 tolerance for the weights (ids: identical)


def ci_lower() -> dict[str, str]:
    return {"gating_topk": lower_ascend(build(384, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5, True))}


def check(seed: int = 0, cases=CASES, tokens=(1, 7, 33)) -> bool:
    g = torch.Generator().manual_seed(seed)
    ok = True
    for e, k, sf, tm, ng, tg, norm, rsf, has_bias in cases:
        kernel = compile_c(build(e, k, sf, tm, ng, tg, norm, rsf, has_bias))
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        for t in tokens:
            logits = torch.randn(t, e, generator=g) * 2
            w, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
            kernel(logits, bias if bias is not None else torch.zeros(e), w, ids)
            rw, rids = reference(logits, bias, e, k, sf, tm, ng, tg, norm, rsf)
            (w, ids), (rw, rids) = by_id(w, ids), by_id(rw, rids)
            ok &= torch.equal(ids, rids) and torch.allclose(w, rw, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    return bool(ok)
