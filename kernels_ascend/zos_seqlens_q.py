"""ZOS ``seqlens_q`` re-split by confidence (the second half of the HAL ``zos_fixup`` op; contract:
backends/cpu/zos.py).

The CPU fixed ``total_q`` (it picks the graph) from older confidences; on the device only the optimistic rows
are re-split, among themselves: each keeps its golden token and their draft slots (the sum of their planned
drafts) go to the highest cumulative acceptance probabilities ``cum[i, j] = prod_{m <= j} p[slot_i, m]`` (only
``j < caps[i]``), ties to the lower flat index ``i*K + j`` (the reference's stable descending sort); each takes
``1 + (its chosen count)`` queries and moves ``seqlens_k`` by the same amount. Other rows keep the CPU's split.

Two kernels, one block per row: ``scores`` writes the masked cumulative products (-1 = not allowed);
``select`` ranks each of its row's K scores against all B*K by counting (no sort: O(K*B*K) compares per row,
fine for B*K in the low thousands) and writes the new lengths. The product is accumulated in fp64 and
rounded once, like torch's CPU cumprod.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, lower_ascend


def build_scores(k: int):
    B = T.dynamic("B")
    S = T.dynamic("S")

    @T.prim_func
    def zos_scores(
        draft_probs: T.Tensor([S, k], "float32"),
        slots: T.Tensor([B], "int32"),
        caps: T.Tensor([B], "int32"),
        optimistic: T.Tensor([B], "int32"),
        score: T.Tensor([B * k], "float32"),
    ):
        with T.Kernel(B) as bx:
            c = T.alloc_var("float64")
            c = T.float64(1.0)
            for j in T.serial(k):
                c = c * T.cast(draft_probs[slots[bx], j], "float64")
                if j < caps[bx] and optimistic[bx] != 0:
                    score[bx * k + j] = T.cast(c, "float32")
                else:
                    score[bx * k + j] = T.float32(-1.0)

    return zos_scores


def build_select(k: int):
    B = T.dynamic("B")

    @T.prim_func
    def zos_select(
        score: T.Tensor([B * k], "float32"),
        seqlens_q: T.Tensor([B], "int32"),
        seqlens_k: T.Tensor([B], "int32"),
        optimistic: T.Tensor([B], "int32"),
        seqlens_q_out: T.Tensor([B], "int32"),
        seqlens_k_out: T.Tensor([B], "int32"),
    ):
        with T.Kernel(B) as bx:
            budget = T.alloc_var("int32")
            chosen = T.alloc_var("int32")
            rank = T.alloc_var("int32")
            budget = 0
            for r in T.serial(B):
                if optimistic[r] != 0:
                    budget = budget + seqlens_q[r] - 1
            chosen = 0
            for j in T.serial(k):
                rank = 0
                for f in T.serial(B * k):
                    if score[f] > score[bx * k + j] or (score[f] == score[bx * k + j] and f < bx * k + j):
                        rank = rank + 1
                if rank < budget and score[bx * k + j] >= T.float32(0.0):
                    chosen = chosen + 1
            if optimistic[bx] != 0:
                seqlens_q_out[bx] = 1 + chosen
                seqlens_k_out[bx] = seqlens_k[bx] - seqlens_q[bx] + 1 + chosen
            else:
                seqlens_q_out[bx] = seqlens_q[bx]
                seqlens_k_out[bx] = seqlens_k[bx]

    return zos_select


def reference(seqlens_q, seqlens_k, optimistic, slots, draft_probs, caps):
    """backends/cpu/zos.py: zos_fixup with a zero correction (isolates the re-split)."""
    from deepinfer_npu.backends.cpu.zos import zos_fixup

    zero = torch.zeros(draft_probs.shape[0], dtype=torch.int64)
    return zos_fixup(seqlens_q, seqlens_k, optimistic.bool(), slots.long(), zero, draft_probs, caps.long())


def ci_lower(k: int = 5) -> dict[str, str]:
    return {"zos_scores": lower_ascend(build_scores(k)), "zos_select": lower_ascend(build_select(k))}


def check(seed: int = 0, k: int = 5) -> bool:
    g = torch.Generator().manual_seed(seed)
    scores_k, select_k = compile_c(build_scores(k)), compile_c(build_select(k))
    ok = True
    for b, s in ((1, 2), (6, 9), (40, 50)):
        caps = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
        sq = (1 + (torch.rand(b, generator=g) * (caps + 1).float()).long().clamp(max=caps.long())).to(
            torch.int32
        )
        sk = sq + torch.randint(5, 300, (b,), generator=g, dtype=torch.int32)
        opt = torch.randint(0, 2, (b,), generator=g, dtype=torch.int32)
        slots = torch.randperm(s, generator=g)[:b].to(torch.int32)
        probs = torch.rand(s, k, generator=g)
        probs[: s // 3] = 1.0  # exact ties: the tie rule must match too
        score = torch.empty(b * k, dtype=torch.float32)
        q_out, k_out = torch.empty(b, dtype=torch.int32), torch.empty(b, dtype=torch.int32)
        scores_k(probs, slots, caps, opt, score)
        select_k(score, sq, sk, opt, q_out, k_out)
        rq, rk = reference(sq, sk, opt, slots, probs, caps)
        ok &= torch.equal(q_out, rq) and torch.equal(k_out, rk)
    return bool(ok)
