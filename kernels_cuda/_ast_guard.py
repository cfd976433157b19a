"""Thread pools for parallel kernel compiles, with Python's AST conversions serialised (CPython < 3.13).

The kernel modules compile several configurations at once in threads so that nvcc runs in parallel, and build
(parse) their kernels on the calling thread first. But TileLang also parses and compiles Python source while it
lowers some kernels: its mma.sync GEMM lowering (``tilelang/cuda/op/gemm/gemm_mma.py``, used by ``mla_decode``'s
16-row tile) builds a ``T.macro`` inside ``tilelang.compile`` (``ast.parse``, then ``compile`` of the rewritten
tree). CPython before 3.13 keeps the AST converter's recursion depth in per-interpreter state (gh-106905), so two
threads converting at once can fail with "AST constructor recursion depth mismatch"; seen here on Python 3.11.7 in
``mla_decode.ci_compile``. ``compile_pool`` puts a lock around ``ast.parse`` and around the ``compile`` TileLang's
eager front end calls; the rest (lowering passes, nvcc) still runs in parallel.
"""

import ast
import builtins
import concurrent.futures as cf
import sys
import threading

# One lock per process, kept on the ast module itself: every wrapper must take the same lock, also when this
# module is reloaded.
_LOCK = ast.__dict__.setdefault("_deepinfer_ast_lock", threading.RLock())


def _locked(fn):
    def call(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)

    call._deepinfer_locked = True
    call.__doc__ = fn.__doc__
    return call


def install() -> None:
    """Wrap ``ast.parse`` and TileLang's front-end ``compile`` with a process-wide lock (idempotent; nothing on
    3.13 and later)."""
    if sys.version_info >= (3, 13):
        return
    if not getattr(ast.parse, "_deepinfer_locked", False):
        ast.parse = _locked(ast.parse)
    try:
        from tilelang.language.eager import utils as eager_utils
    except Exception:  # noqa: BLE001 - no tilelang (or another layout): nothing of it to guard
        return
    if not getattr(getattr(eager_utils, "compile", None), "_deepinfer_locked", False):
        eager_utils.compile = _locked(builtins.compile)  # a module global shadows the builtin for that module


def compile_pool(workers: int) -> cf.ThreadPoolExecutor:
    """A thread pool for ``tilelang.compile`` calls, after :func:`install`."""
    install()
    return cf.ThreadPoolExecutor(max(1, int(workers)))
