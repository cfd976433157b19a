"""kernels_cuda/_producer_wait.py: in TileLang's warp-specialised TMA pipelines only the elected producer thread
waits for a free stage (the other producer threads, kept in step by nothing, hung FP8 engines on an H200).

The rewrite is checked here on hand-written CUDA in the shape TileLang 0.1.15 generates; test_compile.py checks
that every compiled sm_90a kernel comes out rewritten (no wait for a free stage left before an elected TMA block).
"""

from __future__ import annotations

import re

import pytest

from deepinfer_npu.kernels_cuda import _producer_wait as pw
from tests.kernel_compiles import unmoved_producer_waits


PRODUCER = """\
  if (((int)threadIdx.x) < 128) {
    for (int kb = 0; kb < 16; ++kb) {
      mbarrier[((p & 3) + 4)].wait((((p & 7) >> 2) ^ 1));
      if (tl::tl_shuffle_elect<128>()) {
        mbarrier[(p & 3)].arrive_and_expect_tx(8192);
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          tl::tma_load(W_desc, mbarrier[(p & 3)], (&(((fp8_e4_t*)W_s)[(p & 3) * 8192])), (kb * 128), i);
        }
      }
      p = (p + 1);
    }
  } else {
    for (int kb_1 = 0; kb_1 < 16; ++kb_1) {
      mbarrier[(c & 3)].wait(((c & 7) >> 2));
      if (tl::tl_shuffle_elect<128>()) {
        tl::tma_load(X_desc, mbarrier[(c & 3)], X_s, 0, 0);
      }
      mbarrier[((c & 3) + 4)].arrive();
    }
  }
"""

MOVED = """\
      if (tl::tl_shuffle_elect<128>()) {
        mbarrier[((p & 3) + 4)].wait((((p & 7) >> 2) ^ 1));
        mbarrier[(p & 3)].arrive_and_expect_tx(8192);
"""


def test_the_free_stage_wait_moves_into_the_elected_block():
    out = pw.rewrite(PRODUCER)
    assert MOVED in out
    assert out.count(".wait(") == PRODUCER.count(".wait(")  # moved, none added or lost
    assert pw.rewrite(out) == out  # once rewritten, nothing left to move


def test_a_wait_with_the_folded_parity_moves_too():
    # a loop no longer than the pipeline: TileLang folds the free-stage parity to the constant 1
    code = PRODUCER.replace("wait((((p & 7) >> 2) ^ 1));", "wait(1);")
    out = pw.rewrite(code)
    assert "      if (tl::tl_shuffle_elect<128>()) {\n        mbarrier[((p & 3) + 4)].wait(1);\n" in out
    assert unmoved_producer_waits(code) and not unmoved_producer_waits(out)


def test_the_checker_sees_what_the_rewrite_moves():
    assert unmoved_producer_waits(PRODUCER) == ["mbarrier[((p & 3) + 4)].wait((((p & 7) >> 2) ^ 1));"]
    assert unmoved_producer_waits(pw.rewrite(PRODUCER)) == []
    # a wait of another parity form before a producer block is seen too
    odd = PRODUCER.replace("wait((((p & 7) >> 2) ^ 1));", "wait(((p >> 2) & 1) == 0);")
    assert unmoved_producer_waits(odd) == ["mbarrier[((p & 3) + 4)].wait(((p >> 2) & 1) == 0);"]


def test_a_wait_for_a_full_stage_stays_where_it_is():
    # the consumer's wait (no `^ 1`: a stage holding data) is kept by every consumer thread, even before a TMA block
    out = pw.rewrite(PRODUCER)
    assert "      mbarrier[(c & 3)].wait(((c & 7) >> 2));\n      if (tl::tl_shuffle_elect<128>()) {\n" in out


def test_kernels_with_cp_async_copies_are_left_as_generated():
    # every producer thread writes the stage with cp.async and arrives on its barrier there: all must wait
    code = PRODUCER.replace("p = (p + 1);", "tl::cp_async_commit();\n      p = (p + 1);")
    assert pw.rewrite(code) == code


def test_an_elected_block_without_copies_is_left_as_generated():
    code = PRODUCER.replace("tl::tma_load(W_desc", "tl::other_op(W_desc")
    assert MOVED not in pw.rewrite(code)


def test_an_elected_block_that_arms_no_barrier_is_left_as_generated():
    code = PRODUCER.replace("mbarrier[(p & 3)].arrive_and_expect_tx(8192);", "q = q + 1;")
    assert pw.rewrite(code) == code


def test_a_wait_not_directly_before_the_elected_block_is_left_as_generated():
    code = PRODUCER.replace("^ 1));\n      if (tl::", "^ 1));\n      q = q + 1;\n      if (tl::")
    assert pw.rewrite(code) == code


def test_the_mark_keys_builds_apart_and_tracks_the_rules():
    from pathlib import Path
    import hashlib

    key, value = pw.MARK
    assert key == "deepinfer.producer_wait"
    assert value == "elected-" + hashlib.sha256(Path(pw.__file__).read_bytes()).hexdigest()[:12]

    class NotAPrimFunc:
        pass

    thing = NotAPrimFunc()
    assert pw.mark(thing) is thing


def _restore_hook(tvm_ffi, previous):
    """This process's hook as it was before a test replaced it."""
    if previous is not None:
        tvm_ffi.register_global_func(pw._HOOK, f=previous, override=True)
    else:
        tvm_ffi.remove_global_func(pw._HOOK)
        pw.install(force=True)


def test_install_runs_a_hook_registered_before_first(monkeypatch):
    tvm_ffi = pytest.importorskip("tvm_ffi")
    pytest.importorskip("tilelang")
    previous = tvm_ffi.get_global_func(pw._HOOK, allow_missing=True)
    monkeypatch.setattr(pw, "_installed", False)
    tvm_ffi.register_global_func(pw._HOOK, f=lambda code, target: code.replace("tl::other_op", "tl::tma_load"),
                                 override=True)
    try:
        pw.install()
        hook = tvm_ffi.get_global_func(pw._HOOK)
        code = PRODUCER.replace("tl::tma_load(W_desc", "tl::other_op(W_desc")
        assert MOVED in str(hook(code, None))  # the earlier hook restored the copy, then the wait moved
    finally:
        _restore_hook(tvm_ffi, previous)


def test_marking_a_build_puts_the_hook_back_after_another_replaced_it():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    pytest.importorskip("tilelang")
    from tilelang import tvm

    previous = tvm_ffi.get_global_func(pw._HOOK, allow_missing=True)
    tvm_ffi.register_global_func(pw._HOOK, f=lambda code, target: code, override=True)  # e.g. a profiler's
    try:
        assert str(tvm_ffi.get_global_func(pw._HOOK)(PRODUCER, None)) == PRODUCER
        func = tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0))
        assert pw.mark(func).attrs[pw.MARK[0]] == pw.MARK[1]
        assert MOVED in str(tvm_ffi.get_global_func(pw._HOOK)(PRODUCER, None))
    finally:
        _restore_hook(tvm_ffi, previous)


@pytest.mark.tilelang
@pytest.mark.nvcc
def test_a_short_k_tile_gemm_compiles_with_every_producer_wait_moved(monkeypatch, tmp_path):
    """K = 512 is four K blocks, no more than the pipeline's stages: TileLang folds the free-stage parity to 1."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    from deepinfer_npu.kernels_cuda import fp8_gemm

    src = fp8_gemm.ci_compile([("tile", (2048, 512, 128, 128))])[0].get_kernel_source()
    assert "tma_load" in src and not unmoved_producer_waits(src)
    assert re.search(r"if \(tl::tl_shuffle_elect<\d+>\(\)\) \{\n\s*mbarrier\[[^\n]*\]\.wait\(1\);", src)
