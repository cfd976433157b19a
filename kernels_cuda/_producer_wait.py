"""Only the elected producer thread waits for a free pipeline stage in TileLang's warp-specialised TMA pipelines.

TileLang (0.1.15) lowers a ``T.Pipelined`` loop of TMA copies on sm_90 to a producer warpgroup and consumer
warpgroups. In the producer's loop every one of its 128 threads waits on the stage's "free" barrier, then one
elected thread arms the "full" barrier and issues the copies::

    mbarrier[s + 4].wait(parity);          // all 128 producer threads
    if (tl::tl_shuffle_elect<128>()) {     // one thread
      mbarrier[s].arrive_and_expect_tx(bytes);
      tl::tma_load(...);
    }

The other three warps arrive on nothing, so nothing keeps them in step: the consumers need only the elected
thread's copies, and an ``mbarrier`` wait tells phases apart by parity alone. A warp that falls two phases of a
barrier behind (one, at a wait whose parity TileLang folded to the first pass's) waits for a phase that has already
completed, and then for one that never comes. On an H200 this hung FP8 engines (V2-Lite shape, decode batch 64-256
and prefill): ``cuda-gdb`` showed one CTA of ``fp8_grouped_gemm`` left, with producer warps 1-3 in that wait after
every other warp had exited, and in another run one producer warp in it while the rest of its CTA waited at the
next ``__syncthreads()`` (docs/kernels/pdl.md). CUTLASS's producers have one warp wait and one thread issue.

:func:`rewrite` moves each such wait inside the elected thread's block, so the thread that issues a stage's copies
is the one that waits for the stage to be free, and the other producer threads pass straight on (they touch no
stage). It is a CUDA post-processing hook of TileLang (``register_cuda_postproc``), installed at import with
tilelang; it rewrites only a free-stage wait followed directly by an elected block that arms a barrier and issues
TMA copies, in kernels with no ``cp.async`` copies, and leaves any other code as generated. :data:`MARK` goes into
every PrimFunc the engine builds (``_prim_func_cache``; :func:`mark` first checks the hook is still registered), so
a kernel that TileLang compiled before this hook existed is not served from its cache. Kernels compiled from
PrimFuncs built elsewhere get the rewrite but not the mark.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

# a PrimFunc attribute, part of TileLang's cache key: a change to this file's rules is a new key
MARK = ("deepinfer.producer_wait", "elected-" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12])

# a wait for a stage to be free (TileLang passes such a wait the parity `... ^ 1`, a stage being free before its
# first use, or `1` where a loop no longer than the pipeline folds it), then the elected thread's block
_WAIT_THEN_ELECT = re.compile(
    r"^(?P<indent>[ \t]*)(?P<wait>mbarrier\[[^;\n]*\]\.wait\((?:[^;\n]*\^ 1\)|1)\);)\n"
    r"(?P=indent)(?P<elect>if \(tl::tl_shuffle_elect<\d+>\(\)\) \{)\n",
    re.M,
)
# what makes an elected block the producer's: it arms a stage's barrier with the bytes its TMA copies will bring
_ARMS = re.compile(r"\.(arrive_and_expect_tx|expect_transaction)\(")


def _block_end(code: str, open_brace: int) -> int:
    """Index just past the brace that closes the one at ``open_brace``."""
    depth = 0
    for i in range(open_brace, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("unbalanced braces in the generated CUDA source")


def rewrite(code: str) -> str:
    """``code`` with each producer wait that all producer threads run moved into the elected thread's block.

    Only in pure TMA pipelines (no ``cp.async`` in the kernel): there the other producer threads write no stage
    and arrive on no barrier, so none of them needs the stage free. With ``cp.async`` copies every producer thread
    writes the stage and arrives on its barrier, and so must wait; such a kernel is left as generated."""
    if "cp_async" in code:
        return code
    out, pos = [], 0
    for m in _WAIT_THEN_ELECT.finditer(code):
        block = code[m.start("elect"):_block_end(code, m.end("elect") - 1)]
        if "tma_load" not in block or not _ARMS.search(block):  # not the producer's copy-issuing block
            continue
        ind = m.group("indent")
        out.append(code[pos:m.start()])
        out.append(f"{ind}{m.group('elect')}\n{ind}  {m.group('wait')}\n")
        pos = m.end()
    out.append(code[pos:])
    return "".join(out)


def mark(func):
    """``func`` (a PrimFunc) with :data:`MARK` set, so TileLang's cache keys it apart from builds before the hook;
    the hook is checked first (:func:`ensure_installed`), so nothing compiled under the mark misses it."""
    if not hasattr(func, "with_attr"):
        return func
    ensure_installed()
    return func.with_attr(*MARK)


_HOOK = "tilelang_callback_cuda_postproc"
_installed = False
# a producer step as TileLang emits it: the registered hook must move its wait
_PROBE = ("    mbarrier[4].wait(1);\n    if (tl::tl_shuffle_elect<128>()) {\n"
          "      mbarrier[0].arrive_and_expect_tx(16);\n      tl::tma_load(d, mbarrier[0], s, 0);\n    }\n")


def install(force: bool = False) -> None:
    """Register :func:`rewrite` as TileLang's CUDA post-processing hook (this process, once unless ``force``). A
    hook registered before runs first, and ours on its output."""
    global _installed
    if _installed and not force:
        return
    import tvm_ffi
    from tilelang.engine.callback import register_cuda_postproc

    before = tvm_ffi.get_global_func(_HOOK, allow_missing=True)

    def postproc(code: str, target) -> str:
        return rewrite(str(before(code, target)) if before is not None else code)

    register_cuda_postproc(postproc, override=True)
    _installed = True


def ensure_installed() -> None:
    """Install the hook again (after whatever replaced it) unless the registered one rewrites :data:`_PROBE`; a
    no-op without tilelang."""
    try:
        import tvm_ffi
    except ImportError:
        return
    hook = tvm_ffi.get_global_func(_HOOK, allow_missing=True)
    try:
        if hook is not None and str(hook(_PROBE, None)) == rewrite(_PROBE):
            return
    except Exception:  # noqa: BLE001 - a hook that cannot take the probe: ours goes on top of it
        pass
    install(force=True)
