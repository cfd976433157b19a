"""Built PrimFuncs persist across processes (kernels_cuda/_prim_func_cache.py): a stored factory result is loaded
instead of built, prints the same script (TileLang's cache key, so its disk cache serves the same kernel), and a
corrupt entry, other arguments or a changed kernel source build again. No GPU needed."""

import pytest

from deepinfer_npu.kernels_cuda import _prim_func_cache as pfc

pytestmark = pytest.mark.tilelang


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    return tmp_path


def counting_factory():
    from deepinfer_npu.kernels_cuda._tilelang import T

    calls = []

    @pfc.cached_prim_func
    def build_scale(n: int, factor: float):
        calls.append((n, factor))

        @T.prim_func
        def scale(A: T.Tensor([n], T.float32), B: T.Tensor([n], T.float32)):
            with T.Kernel(1, threads=128):
                for i in T.Parallel(n):
                    B[i] = A[i] * factor

        return scale

    return build_scale, calls


def test_a_stored_prim_func_is_loaded_not_built(cache_dir):
    build, calls = counting_factory()
    first = build(256, 2.0)
    again = build(256, 2.0)
    assert calls == [(256, 2.0)]
    assert again.script(show_meta=True) == first.script(show_meta=True)
    assert len(list(pfc.cache_root().glob("*build_scale*.json"))) == 1
    build(256, 3.0)  # other arguments: another entry
    assert calls == [(256, 2.0), (256, 3.0)]


def test_a_corrupt_entry_is_rebuilt_and_rewritten(cache_dir):
    build, calls = counting_factory()
    first = build(128, 2.0)
    (path,) = pfc.cache_root().glob("*build_scale*.json")
    path.write_text("{not json")
    rebuilt = build(128, 2.0)
    assert len(calls) == 2 and rebuilt.script() == first.script()
    build(128, 2.0)
    assert len(calls) == 2  # the rewritten entry serves


def test_a_changed_kernel_source_starts_a_new_directory(cache_dir, monkeypatch):
    build, calls = counting_factory()
    build(64, 2.0)
    monkeypatch.setattr(pfc, "fingerprint", lambda: "another-source")
    build(64, 2.0)
    assert len(calls) == 2 and pfc.cache_root().name == "another-source"


def test_an_unwritable_cache_still_builds(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(blocker))  # a file: no directory can be made under it
    build, calls = counting_factory()
    build(32, 2.0)
    build(32, 2.0)
    assert len(calls) == 2


def test_engine_factories_round_trip(cache_dir):
    """The decode kernel's and the RMSNorm's factories: the loaded functions print the built ones' scripts (with
    the producer-wait mark, which the cached factories add: kernels_cuda/_producer_wait.py)."""
    from deepinfer_npu.kernels_cuda import mla_decode, rms_norm
    from deepinfer_npu.kernels_cuda._producer_wait import MARK

    for build, args in ((mla_decode.build_mla_decode, (16, 1, mla_decode.DYNAMIC_SPLITS, 0.1)),
                        (rms_norm.build_rms_norm, (2048, True, 1e-6))):
        built = build.uncached(*args).with_attr(*MARK).script(show_meta=True)
        assert build(*args).script(show_meta=True) == built  # stored on the way
        assert build(*args).script(show_meta=True) == built  # loaded


def test_a_new_fingerprint_prunes_all_but_the_newest_old_directories(cache_dir, monkeypatch):
    import os

    base = cache_dir / "prim_funcs"
    for i in range(5):  # older fingerprints, oldest first
        d = base / f"old{i}"
        d.mkdir(parents=True)
        os.utime(d, (1000 + i, 1000 + i))
    build, _ = counting_factory()
    monkeypatch.setattr(pfc, "fingerprint", lambda: "current")
    build(16, 2.0)
    kept = sorted(d.name for d in base.iterdir())
    assert kept == sorted(["current", *[f"old{i}" for i in range(5 - pfc.KEEP_DIRS, 5)]])
