"""Programmatic dependent launch (PDL) for the engine's TileLang kernels (sm_90 and later), unless DEEPINFER_PDL_OFF.

A kernel of the engine's decode chain (but those ``DEEPINFER_PDL_OFF`` names) starts with ``T.pdl_sync()``
(``griddepcontrol.wait``: the previous kernel of its stream has finished and its writes are visible) and then
``T.pdl_trigger()`` (the next kernel may launch).
TileLang launches such a kernel with programmatic stream serialization (``cuLaunchKernelEx``; CUDA graphs capture it
as a programmatic edge), so its CTAs are placed on the SMs while the previous kernel still runs and the launch gap
is hidden. At batch 1 a V2-Lite decode step is ~650 kernels of 1-25 us, so that gap is a large share of a step:
with PDL batch 1 ran at 411 against 397 tok/s on an H200, batch 16 and 64 1.3-1.6 % faster.

Why it is safe: before its wait a kernel only loads weights (skinny_gemm's first vectors, mla_absorb's whole
slice), which no kernel writes; every other global access comes after it, so reads see everything the previous
kernels wrote, and writes cannot race a previous kernel's reads. The trigger comes after the wait, so at most one
kernel waits ahead of the one running. Kernels not built with PDL (torch, cuBLAS) wait for the full completion of
what precedes them; a PDL kernel after one of them waits for its completion too.

``DEEPINFER_PDL_OFF`` names the kernels built without it: kernel-name prefixes (e.g. ``fp8``: the FP8 GEMM and
quantisation kernels; ``mla_decode_split_fp8`` and the expert scan keep PDL), ``all`` or ``none`` (the default: every
kernel with PDL). Such a PrimFunc loses its wait and trigger before it is compiled; TileLang's default (tvm_ffi)
execution backend then launches it without programmatic stream serialization, because it sets that launch attribute
only for a kernel with the wait (``lower_pdl.cc``), so it starts after the previous kernel ends and the next one
starts after it ends. TileLang also marks a kernel's pointer parameters ``__restrict__`` only without the wait, so
such a build differs in that too. FP8 decode graphs that hung on an H200 were first blamed on PDL; they hung without
it as well, in a TileLang pipeline's producer wait (``_producer_wait.py``, docs/kernels/pdl.md).
"""

from __future__ import annotations

from deepinfer_npu import envs

_PDL_OPS = ("tl.pdl_sync", "tl.pdl_trigger")


def pdl_enabled() -> bool:
    """True when some kernels are built with PDL (``DEEPINFER_PDL_OFF`` is not ``all``; result rows record it)."""
    return "" not in off_prefixes()


def off_prefixes() -> tuple[str, ...]:
    """The kernel-name prefixes ``DEEPINFER_PDL_OFF`` names (``("",)`` for ``all``: every name; ``()`` for
    ``none``)."""
    raw = envs.PDL_OFF.strip()
    if raw.lower() == "all":
        return ("",)
    if raw.lower() == "none":
        return ()
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def built_without(name: str, prefixes: tuple[str, ...] | None = None) -> bool:
    """Whether the kernel (PrimFunc) called ``name`` is built without PDL (``prefixes``: ``off_prefixes()``'s)."""
    return any(name.startswith(p) for p in (off_prefixes() if prefixes is None else prefixes))


def apply_setting(func):
    """``func`` as ``DEEPINFER_PDL_OFF`` wants it: unchanged, or with its PDL wait and trigger removed (then TileLang
    neither emits ``griddepcontrol`` nor launches it with programmatic stream serialization)."""
    prefixes = off_prefixes()  # the setting read once a build
    if not prefixes or not hasattr(func, "with_body"):  # a PrimFunc: every kernels_cuda builder returns one
        return func
    name = str(func.attrs["global_symbol"]) if func.attrs is not None and "global_symbol" in func.attrs else ""
    if not built_without(name, prefixes):
        return func
    from tilelang import tvm

    tirx = tvm.tirx

    def drop(stmt):
        call = stmt.value
        if isinstance(call, tirx.Call) and getattr(call.op, "name", "") in _PDL_OPS:
            return tirx.Evaluate(0)
        return None

    return func.with_body(tirx.stmt_functor.ir_transform(func.body, None, drop, ["tirx.Evaluate"]))
