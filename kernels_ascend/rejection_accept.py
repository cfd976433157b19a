"""The uniform-threshold part of lossless rejection sampling with one-hot (argmax) draft proposals.

Draft ``draft_{j+1}`` is accepted iff ``u_j < p_j(draft_{j+1})`` (``u_j`` from the hash RNG, ``p_j`` the
target
distribution after token ``j``); a row accepts the longest prefix. This kernel takes ``u`` [N] and
``p_draft`` [N] (a gather from the softmax, done by aten ops) and writes ``ok`` [N] and ``accepted`` [B]; the
residual and bonus samples stay with the sampler (backends/cpu/spec_verify.py). One block per row.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, lower_ascend


def build(max_q: int):
    B = T.dynamic("B")
    N = T.dynamic("N")

    @T.prim_func
    def rejection_accept(
        u: T.Tensor([N], "float32"),
        p_draft: T.Tensor([N], "float32"),
        draft_next: T.Tensor([N], "int32"),
        cu_seqlens_q: T.Tensor([B + 1], "int32"),
        ok: T.Tensor([N], "int32"),
        accepted: T.Tensor([B], "int32"),
    ):
        with T.Kernel(B) as bx:
            a = T.alloc_var("int32")
            live = T.alloc_var("int32")
            a = 0
            live = 1
            for j in T.serial(max_q):
                if j < cu_seqlens_q[bx + 1] - cu_seqlens_q[bx]:
                    r = cu_seqlens_q[bx] + j
                    if draft_next[r] >= 0 and u[r] < p_draft[r]:
                        ok[r] = 1
                        if live == 1:
                            a = a + 1
                    else:
                        ok[r] = 0
                        live = 0
            accepted[bx] = a

    return rejection_accept


def reference(u, p_draft, draft_next, cu_seqlens_q, max_q):
    """As backends/cpu/spec_verify.py: ``ok = (u < p_draft) & has_draft``; accepted = leading run of ok."""
    q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    b = q.numel()
    row = torch.repeat_interleave(torch.arange(b), q)
    j = torch.arange(row.numel()) - cu_seqlens_q[:-1].long().index_select(0, row)
    ok = (u < p_draft) & (draft_next >= 0)
    ok_pad = torch.zeros(b, max_q, dtype=torch.int64)
    ok_pad[row, j] = ok.long()
    return ok, torch.cumprod(ok_pad, dim=1).sum(dim=1)


def ci_lower(max_q: int = 16) -> dict[str, str]:
    return {"rejection_accept": lower_ascend(build(max_q))}


def check(seed: int = 0, max_q: int = 6) -> bool:
    g = torch.Generator().manual_seed(seed)
    kernel = compile_c(build(max_q))
    good = True
    for b in (1, 4, 50):
        q = torch.randint(1, max_q + 1, (b,), generator=g)
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(q, 0)
        n = int(cu[-1])
        u, p = torch.rand(n, generator=g), torch.rand(n, generator=g)
        p[::3] = u[::3]  # equality must reject (strict <)
        draft = torch.randint(0, 9, (n,), generator=g, dtype=torch.int32)
        draft[(cu[1:] - 1).long()] = -1
        ok, acc = torch.empty(n, dtype=torch.int32), torch.empty(b, dtype=torch.int32)
        kernel(u, p, draft, cu, ok, acc)
        r_ok, r_acc = reference(u, p, draft, cu, max_q)
        good &= torch.equal(ok.bool(), r_ok) and torch.equal(acc.long(), r_acc)
    return bool(good)
