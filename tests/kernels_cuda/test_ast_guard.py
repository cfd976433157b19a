"""kernels_cuda._ast_guard: the thread pools that run parallel TileLang compiles serialise Python's AST conversions
(CPython < 3.13, gh-106905: "AST constructor recursion depth mismatch" seen in mla_decode.ci_compile on 3.11.7,
where TileLang's mma.sync GEMM lowering parses and compiles a macro inside tilelang.compile)."""

import ast
import sys
import threading

import pytest

from deepinfer_npu.kernels_cuda import _ast_guard


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="the AST converter is thread-safe from CPython 3.13")
@pytest.mark.tilelang
def test_compile_pool_locks_parse_and_tilelang_compile():
    with _ast_guard.compile_pool(2) as ex:
        assert ex._max_workers == 2
    from tilelang.language.eager import utils as eager_utils

    assert getattr(ast.parse, "_deepinfer_locked", False)
    assert getattr(eager_utils.compile, "_deepinfer_locked", False)
    before = ast.parse
    _ast_guard.install()  # idempotent: not wrapped twice
    assert ast.parse is before
    assert ast.dump(ast.parse("x + 1")) == "Module(body=[Expr(value=BinOp(left=Name(id='x', ctx=Load()), " \
                                           "op=Add(), right=Constant(value=1)))], type_ignores=[])"


def test_parse_waits_for_the_lock():
    """While another thread holds the lock, a parse through the guard waits for it."""
    _ast_guard.install()
    if not getattr(ast.parse, "_deepinfer_locked", False):
        pytest.skip("no guard on this Python")
    done = threading.Event()
    with _ast_guard._LOCK:
        t = threading.Thread(target=lambda: (ast.parse("y = 2"), done.set()))
        t.start()
        assert not done.wait(0.2)  # blocked on the lock
    t.join(5)
    assert done.is_set()


def test_one_lock_per_process():
    """A second copy of the module (a reload) guards with the same lock: a parse wrapped by one copy and a compile
    wrapped by another must not run at once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_ast_guard_copy", _ast_guard.__file__)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    assert copy is not _ast_guard and copy._LOCK is _ast_guard._LOCK
