"""Greedy draft verification: accept the longest prefix of drafts equal to the target's argmax, plus one
bonus.

Per row ``i`` with tokens ``[cu[i], cu[i+1])`` (``[last, draft_1 .. draft_d]``): ``draft_next[r]`` is the
draft
proposed for the position after token ``r`` (-1 at the row's last token) and ``greedy[r]`` the target's argmax
there (``torch.argmax`` over the vocabulary runs as an aten op before this kernel). Outputs follow
backends/cpu/spec_verify.py's greedy branch: ``accepted[i]``, ``target_tokens[r]`` (the draft where accepted,
the argmax from the first rejection on), ``emitted[i, :accepted+1]`` (-1 padded). One block per row.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, lower_ascend


def build(max_q: int):
    B = T.dynamic("B")
    N = T.dynamic("N")

    @T.prim_func
    def spec_verify_greedy(
        greedy: T.Tensor([N], "int32"),
        draft_next: T.Tensor([N], "int32"),
        cu_seqlens_q: T.Tensor([B + 1], "int32"),
        accepted: T.Tensor([B], "int32"),
        target_tokens: T.Tensor([N], "int32"),
        emitted: T.Tensor([B, max_q], "int32"),
    ):
        with T.Kernel(B) as bx:
            a = T.alloc_var("int32")
            live = T.alloc_var("int32")
            a = 0
            live = 1
            for j in T.serial(max_q):
                if j < cu_seqlens_q[bx + 1] - cu_seqlens_q[bx]:
                    r = cu_seqlens_q[bx] + j
                    if live == 1 and draft_next[r] >= 0 and greedy[r] == draft_next[r]:
                        a = a + 1
                    else:
                        live = 0
            accepted[bx] = a
            for j in T.serial(max_q):
                emitted[bx, j] = -1
                if j < cu_seqlens_q[bx + 1] - cu_seqlens_q[bx]:
                    r = cu_seqlens_q[bx] + j
                    if j < a:
                        target_tokens[r] = draft_next[r]
                    else:
                        target_tokens[r] = greedy[r]
                    if j <= a:
                        emitted[bx, j] = target_tokens[r]

    return spec_verify_greedy


def reference(greedy, draft_next, cu_seqlens_q, max_q):
    """Line-for-line the greedy branch of backends/cpu/spec_verify.py: spec_verify."""
    q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    b = q.numel()
    row = torch.repeat_interleave(torch.arange(b), q)
    j = torch.arange(row.numel()) - cu_seqlens_q[:-1].long().index_select(0, row)
    greedy, draft_next = greedy.long(), draft_next.long()
    has_draft = draft_next >= 0
    safe = draft_next.clamp(min=0)
    ok = (greedy == safe) & has_draft
    ok_pad = torch.zeros(b, max_q, dtype=torch.int64)
    ok_pad[row, j] = ok.long()
    accepted = torch.cumprod(ok_pad, dim=1).sum(dim=1)
    acc_tok = accepted.index_select(0, row)
    target = torch.where(j < acc_tok, safe, greedy)
    emitted = torch.full((b, max_q), -1, dtype=torch.int64)
    live = j <= acc_tok
    emitted[row[live], j[live]] = target[live]
    return accepted, target, emitted


def ci_lower(max_q: int = 16) -> dict[str, str]:
    return {"spec_verify_greedy": lower_ascend(build(max_q))}


def check(seed: int = 0, max_q: int = 6) -> bool:
    g = torch.Generator().manual_seed(seed)
    kernel = compile_c(build(max_q))
    ok = True
    for b in (1, 5, 33):
        q = torch.randint(1, max_q + 1, (b,), generator=g)
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(q, 0)
        n = int(cu[-1])
        greedy = torch.randint(0, 4, (n,), generator=g, dtype=torch.int32)  # small vocab: many matches
        draft = torch.randint(0, 4, (n,), generator=g, dtype=torch.int32)
        draft[(cu[1:] - 1).long()] = -1  # no draft after a row's last token
        acc = torch.empty(b, dtype=torch.int32)
        target = torch.full((n,), -9, dtype=torch.int32)
        emitted = torch.empty(b, max_q, dtype=torch.int32)
        kernel(greedy, draft, cu, acc, target, emitted)
        ra, rt, re = reference(greedy, draft, cu, max_q)
        live = torch.arange(n) - cu[:-1].long().repeat_interleave(q) <= ra.repeat_interleave(q)
        ok &= torch.equal(acc.long(), ra) and torch.equal(emitted.long(), re)
        ok &= torch.equal(target.long()[live], rt[live])  # past the first rejection the reference's is moot
    return bool(ok)
