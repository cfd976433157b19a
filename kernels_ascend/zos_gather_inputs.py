"""ZOS input fix-up: each row's first token comes from the previous step's device outputs when the CPU could
not
know it (host id -1).

``first[i] = host_first[i] if host_first[i] >= 0 else source[index[i]]``. The worker today gathers the last
emitted token from the request's state slot (``index = slots``, ``source = last_token``); the remap form of
the
design (``index = prev_remap``, ``source = previous step's last emitted token per row``) is the same kernel.
One block per row; scalar code on the vector core (latency-bound, B <= a few hundred).
"""

# No ``from __future__ import annotations``: TileLang evaluates the T.Tensor annotations at definition.
import torch

from ._tl import T, compile_c, lower_ascend


def build():
    B = T.dynamic("B")
    S = T.dynamic("S")

    @T.prim_func
    def zos_gather_inputs(
        host_first: T.Tensor([B], "int32"),
        index: T.Tensor([B], "int32"),
        source: T.Tensor([S], "int32"),
        first: T.Tensor([B], "int32"),
    ):
        with T.Kernel(B) as bx:
            if host_first[bx] >= 0:
                first[bx] = host_first[bx]
            else:
                first[bx] = source[index[bx]]

    return zos_gather_inputs


def reference(host_first: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """As worker.py: ``torch.where(first >= 0, first, last_token.index_select(0, slot))``."""
    return torch.where(host_first >= 0, host_first, source.index_select(0, index.long()))


def ci_lower() -> dict[str, str]:
    return {"zos_gather_inputs": lower_ascend(build())}


def check(seed: int = 0) -> bool:
    g = torch.Generator().manual_seed(seed)
    kernel = compile_c(build())
    ok = True
    for b, s in ((1, 1), (7, 13), (64, 80)):
        host = torch.randint(-1, 50, (b,), generator=g, dtype=torch.int32)
        index = torch.randint(0, s, (b,), generator=g, dtype=torch.int32)
        source = torch.randint(0, 1000, (s,), generator=g, dtype=torch.int32)
        out = torch.full((b,), -7, dtype=torch.int32)
        kernel(host, index, source, out)
        ok &= torch.equal(out, reference(host, index, source))
    return bool(ok)
