"""mla_decode_ws's schedule switches (no GPU, no compile): the default schedule, each schedule's switch defaults
read when a kernel is asked for, precompile building exactly the kernels get_kernel will ask for (session 9, call 3:
with a switch turned on in the process it built the switch's import-time default, and get_kernel's priming then
compiled every configuration again, one at a time), and the environment switch's error."""

import inspect

import pytest

pytest.importorskip("tilelang")

from deepinfer_npu.kernels_cuda import mla_decode_seesaw as seesaw  # noqa: E402
from deepinfer_npu.kernels_cuda import mla_decode_ws as ws  # noqa: E402


def test_the_seesaw_schedule_is_the_default_with_its_own_thread_count(monkeypatch):
    assert ws.SCHEDULE == ws._schedule_from_env()  # the module's default is the environment's
    monkeypatch.setattr(ws, "SCHEDULE", "seesaw")
    assert ws.schedule_switches()["schedule"] == "seesaw"
    assert ws.threads() == seesaw.THREADS == 256 and ws.threads("ws") == ws.THREADS == 384


def test_switch_defaults_follow_the_schedule_and_are_read_at_call_time(monkeypatch):
    assert ws.schedule_switches("seesaw") == {"schedule": "seesaw", "overlap": False, "prefetch_tiles": 0}
    monkeypatch.setattr(ws, "PREFETCH_TILES", 4)
    monkeypatch.setattr(ws, "OVERLAP_SOFTMAX", True)
    assert ws.schedule_switches("ws") == {"schedule": "ws", "overlap": True, "prefetch_tiles": 4}
    assert ws.schedule_switches("ws", prefetch_tiles=0)["prefetch_tiles"] == 0  # an explicit value wins
    assert ws.schedule_switches("seesaw")["prefetch_tiles"] == 0  # the ws switches do not leak into the other one


def test_precompile_builds_what_get_kernel_asks_for(monkeypatch):
    sig = inspect.signature(ws.build_mla_decode_ws)

    def build(*a, **k):  # record every argument of the build as the real function would see it
        bound = sig.bind(*a, **k)
        bound.apply_defaults()
        built.append(dict(bound.arguments))
        return tuple(sorted(bound.arguments.items()))

    built = []
    monkeypatch.setattr(ws, "build_mla_decode_ws", build)
    monkeypatch.setattr(ws, "_compile", lambda f: f)
    monkeypatch.setattr(ws, "SCHEDULE", "ws")  # as `--schedule ws` does
    monkeypatch.setattr(ws, "PREFETCH_TILES", 4)  # a switch changed after import
    ws._get_kernel.cache_clear()
    try:
        ws.precompile([(128, 2, 1), (16, 1, 2)], softmax_scale=0.125)
        assert len(built) == 4  # two from precompile's pool, two from priming get_kernel's cache
        pooled, primed = built[:2], built[2:]
        assert pooled == primed, (pooled, primed)
        assert all(k["prefetch_tiles"] == 4 and k["schedule"] == "ws" for k in built)
        n = len(built)
        ws.get_kernel(128, 2, 1, 0.125)  # the launcher's call: served from the cache precompile primed
        assert len(built) == n
    finally:
        ws._get_kernel.cache_clear()


def test_schedule_switches_are_checked():
    with pytest.raises(AssertionError, match="no such switches"):
        ws.build_mla_decode_ws(128, 2, 1, 0.125, schedule="seesaw", overlap=True)
    with pytest.raises(AssertionError, match="no such switches"):
        ws.build_mla_decode_ws(128, 2, 1, 0.125, schedule="seesaw", prefetch_tiles=4)
    with pytest.raises(AssertionError, match="one of"):
        ws.build_mla_decode_ws(128, 2, 1, 0.125, schedule="pingpong")


def test_build_resolves_the_switches_of_its_schedule(monkeypatch):
    """A direct build takes the schedule's defaults read now: the ws schedule's prefetch default does not reach a
    seesaw build (which has no such switch), and a changed module default reaches a ws build."""
    got = []
    monkeypatch.setattr(seesaw, "build_mla_decode_seesaw", lambda *a: got.append(("seesaw", a)))
    monkeypatch.setattr(ws, "PREFETCH_TILES", 4)
    ws.build_mla_decode_ws(128, 2, 1, 0.125, schedule="seesaw")
    assert got == [("seesaw", (128, 2, 1, 0.125, True))]


def test_the_environment_names_a_bad_schedule(monkeypatch):
    monkeypatch.setenv("DEEPINFER_CUDA_MLA_SCHEDULE", "pingpong")
    with pytest.raises(ValueError, match="DEEPINFER_CUDA_MLA_SCHEDULE='pingpong': one of ws, seesaw"):
        ws._schedule_from_env()
    monkeypatch.setenv("DEEPINFER_CUDA_MLA_SCHEDULE", "ws")
    assert ws._schedule_from_env() == "ws"
    monkeypatch.delenv("DEEPINFER_CUDA_MLA_SCHEDULE")
    assert ws._schedule_from_env() == "seesaw"
