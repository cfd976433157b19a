"""kernels_cuda/_producer_wait.py: in TileLang's warp-specialised TMA pipelines only the elected producer thread
waits for a free stage (the other producer threads, kept in step by nothing, hung FP8 engines on an H200).

The rewrite is checked here on hand-written CUDA in the shape TileLang 0.1.15 generates; test_compile.py checks
that every compiled sm_90a kernel comes out rewritten (no wait for a free stage left before an elected TMA block).
"""

from __future__ import annotations

from deepinfer_npu.kernels_cuda import _producer_wait as pw

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


def test_install_runs_a_hook_registered_before_first(monkeypatch):
    import pytest

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
    finally:  # this process's hook as it was
        if previous is not None:
            tvm_ffi.register_global_func(pw._HOOK, f=previous, override=True)
