"""ZOS ``seqlens_k`` correction by accepted counts (the first half of the HAL ``zos_fixup`` op).

Rows planned optimistically assumed every draft of the previous step was accepted; the previous step's
verification wrote ``correction[slot] = drafts - accepted`` on the device, so
``seqlens_k[i] -= correction[slots[i]]`` where ``optimistic[i]``. (In remap form:
``seqlens_k[i] -= (prev_seqlens_q[remap[i]] - 1) - prev_accepted[remap[i]]`` for ``remap[i] >= 0`` — the same
number, indexed by the previous step's row instead of the state slot.) One block per row.
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, lower_ascend


def build():
    B = T.dynamic("B")
    S = T.dynamic("S")

    @T.prim_func
    def zos_seqlens_k(
        seqlens_k: T.Tensor([B], "int32"),
        optimistic: T.Tensor([B], "int32"),
        slots: T.Tensor([B], "int32"),
        correction: T.Tensor([S], "int32"),
        seqlens_k_out: T.Tensor([B], "int32"),
    ):
        with T.Kernel(B) as bx:
            if optimistic[bx] != 0:
                seqlens_k_out[bx] = seqlens_k[bx] - correction[slots[bx]]
            else:
                seqlens_k_out[bx] = seqlens_k[bx]

    return zos_seqlens_k


def reference(seqlens_k, optimistic, slots, correction) -> torch.Tensor:
    """The seqlens_k part of backends/cpu/zos.py: zos_fixup."""
    from deepinfer_npu.backends.cpu.zos import zos_fixup

    sq = torch.ones_like(seqlens_k)
    return zos_fixup(sq, seqlens_k, optimistic.bool(), slots.long(), correction)[1]


def ci_lower() -> dict[str, str]:
    return {"zos_seqlens_k": lower_ascend(build())}


def check(seed: int = 0) -> bool:
    g = torch.Generator().manual_seed(seed)
    kernel = compile_c(build())
    ok = True
    for b, s in ((1, 2), (9, 11), (128, 160)):
        sk = torch.randint(20, 500, (b,), generator=g, dtype=torch.int32)
        opt = torch.randint(0, 2, (b,), generator=g, dtype=torch.int32)
        slots = torch.randperm(s, generator=g)[:b].to(torch.int32)
        corr = torch.randint(0, 6, (s,), generator=g, dtype=torch.int32)
        out = torch.zeros(b, dtype=torch.int32)
        kernel(sk, opt, slots, corr, out)
        ok &= torch.equal(out, reference(sk, opt, slots, corr))
    return bool(ok)
