"""The launch of kernels_cuda.mla_decode (and of mla_decode_ws on its 64-row tiles) calls ``get_kernel`` exactly as
its ``precompile`` primes it, so every configuration the warm-up compiled is found at its first launch; a failed
mla_decode_ws compile leaves the pipelined kernel in its place. No GPU: the builders and kernels are recorders."""

from __future__ import annotations

import pytest
import torch

from deepinfer_npu.kernels_cuda import mla_decode as md

pytestmark = pytest.mark.tilelang

SMS = 132  # H200


def test_mla_decode_precompile_takes_prefill_configs(monkeypatch):
    """The 4-tuple form builds the causal-tile-bound variant and primes get_kernel with the launcher's own call."""
    built, primed = [], []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: built.append((a, k)) or object())
    monkeypatch.setattr(md.tilelang, "compile", lambda f, **k: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([(16, 1, 4), (16, 8, 1, True)], softmax_scale=0.125)
    assert [k.get("causal_tile_bound") for _a, k in built] == [False, True]
    assert primed == [((16, 1, 4, 0.125), {}), ((16, 8, 1, 0.125), {"causal_tile_bound": True})]


def test_mla_decode_launch_uses_precompile_call_form(monkeypatch):
    """get_kernel is a functools.cache keyed on the call's spelling: the launch must call it exactly as precompile
    primes it, or every warmed-up configuration is rebuilt at its first launch."""
    calls = []
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: calls.append((a, k)) or (lambda *args: None))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    args = (torch.zeros(1, 16, 512, dtype=bf), torch.zeros(1, 16, 64, dtype=bf), torch.zeros(2, 64, 576, dtype=bf),
            torch.zeros(1, 2, dtype=torch.int32), one, one, cu, 0.125)
    md.mla_decode(*args, max_seqlen_q=1, num_splits=2, num_sms=SMS)  # 16 rows: the small tile
    md.mla_decode(*args, max_seqlen_q=1, num_splits=2, num_sms=SMS, num_stages=1, threads=128)  # a sweep's call
    md.mla_decode(*args, max_seqlen_q=2, num_splits=2, num_sms=SMS)  # 32 rows: the 64-row tile
    monkeypatch.undo()
    primed = []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: object())
    monkeypatch.setattr(md.tilelang, "compile", lambda f, **k: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([md.decode_config(16, 1, 2), md.decode_config(16, 2, 2)], softmax_scale=0.125)
    D = md.DYNAMIC_SPLITS  # two splits: the build that serves every count above 1
    assert calls[0] == primed[0] == ((16, 1, D, 0.125, 2), {"threads": 128, "block_m": 16})
    assert calls[1] == ((16, 1, D, 0.125, 1), {"threads": 128, "block_m": 16, "skip_empty_splits": False})
    assert calls[2] == primed[1] == ((16, 1, D, 0.125), {})


def test_mla_decode_ws_launch_uses_precompile_call_form(monkeypatch):
    """The warp-specialized launch calls mla_decode_ws.get_kernel as its precompile primes it, with Q and Q_pe as
    [T * H, D] row views; a 16-row step keeps the small pipelined tile even when asked for it."""
    from deepinfer_npu.kernels_cuda import mla_decode_ws as ws

    launched, small = [], []
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: lambda *args: launched.append((a, k, args[0].shape,
                                                                                         args[1].shape)))
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: small.append((a, k)) or (lambda *args: None))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    args = (torch.zeros(2, 16, 512, dtype=bf), torch.zeros(2, 16, 64, dtype=bf), torch.zeros(2, 64, 576, dtype=bf),
            torch.zeros(1, 2, dtype=torch.int32), one * 2, one * 2, cu, 0.125)
    md.mla_decode(*args, max_seqlen_q=2, num_splits=2, num_sms=SMS, warp_specialized=True)
    D = md.DYNAMIC_SPLITS
    assert launched == [((16, 1, D, 0.125), {}, (32, 512), (32, 64))] and not small
    md.mla_decode(args[0][:1], args[1][:1], *args[2:4], one, one, torch.tensor([0, 1], dtype=torch.int32), 0.125,
                  max_seqlen_q=1, num_splits=2, num_sms=SMS, warp_specialized=True)
    assert len(launched) == 1 and small == [((16, 1, D, 0.125, 2), {"threads": 128, "block_m": 16})]
    monkeypatch.undo()
    primed = []
    monkeypatch.setattr(ws, "build_mla_decode_ws", lambda *a, **k: object())
    monkeypatch.setattr(ws, "_compile", lambda f: f)
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: primed.append((a, k)))
    md.precompile([md.decode_config(16, 2, 2, warp_specialized=True)], softmax_scale=0.125)
    assert primed == [((16, 1, D, 0.125), {})]


def test_mla_decode_ws_compile_failure_falls_back_to_the_pipelined_kernel(monkeypatch):
    """A failed mla_decode_ws compile turns that kernel off (with the reason), compiles the pipelined 64-row kernel
    for the same configurations instead, and the launch then takes it: mla_decode stays on."""
    from deepinfer_npu.kernels_cuda import mla_decode_ws as ws

    monkeypatch.setattr(ws, "disabled_reason", None)

    def boom(*a, **k):
        raise RuntimeError("nvcc: out of memory")

    monkeypatch.setattr(ws, "precompile", boom)
    built = []
    monkeypatch.setattr(md, "build_mla_decode", lambda *a, **k: built.append(a[:3]) or object())
    monkeypatch.setattr(md, "compile_sm90", lambda f: f)
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: (lambda *args: None))
    md.precompile([md.decode_config(16, 2, 2, warp_specialized=True), md.decode_config(16, 1, 4)], 0.125)
    assert ws.disabled_reason == "compile failed: RuntimeError: nvcc: out of memory"
    D = md.DYNAMIC_SPLITS
    assert built == [(16, 1, D), (16, 1, D)]  # the small tile's, and the 64-row tile's in ws' stead
    launched = []
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: launched.append((a, k)) or (lambda *args: None))
    monkeypatch.setattr(ws, "get_kernel", lambda *a, **k: pytest.fail("mla_decode_ws is off"))
    bf = torch.bfloat16
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    q, q_pe, kv = (torch.zeros(2, 16, 512, dtype=bf), torch.zeros(2, 16, 64, dtype=bf),
                   torch.zeros(2, 64, 576, dtype=bf))
    md.mla_decode(q, q_pe, kv, torch.zeros(1, 2, dtype=torch.int32), one * 2, one * 2, cu, 0.125, max_seqlen_q=2,
                  num_splits=2, num_sms=SMS, warp_specialized=True)
    assert launched == [((16, 1, D, 0.125), {})]


def test_one_split_launches_pass_tiny_placeholder_partials(monkeypatch):
    """A one-split build never touches the partials: its launches (decode and prefill) pass one-value placeholders,
    not [1, T, H, 512] fp32 buffers (4 GiB for a 131072-token prefill chunk); a split launch passes [S, T, H, 512]."""
    seen = []
    monkeypatch.setattr(md, "get_kernel", lambda *a, **k: lambda *args: seen.append((a[2], args[-2].shape,
                                                                                     args[-1].shape)))
    bf = torch.bfloat16
    t = 40
    one, cu = torch.ones(1, dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32)
    args = (torch.zeros(t, 16, 512, dtype=bf), torch.zeros(t, 16, 64, dtype=bf), torch.zeros(2, 64, 576, dtype=bf),
            torch.zeros(1, 2, dtype=torch.int32), one * t, one * t, cu, 0.125)
    md.mla_prefill(*args, max_seqlen_q=t)
    md.mla_decode(*args[:4], one, one * t, torch.tensor([0, 1], dtype=torch.int32), 0.125, max_seqlen_q=1,
                  num_splits=1, num_sms=SMS)
    md.mla_decode(*args[:4], one, one * t, torch.tensor([0, 1], dtype=torch.int32), 0.125, max_seqlen_q=1,
                  num_splits=3, num_sms=SMS)
    assert seen[0] == seen[1] == (1, (1, 1, 1, 1), (1, 1, 1))
    assert seen[2] == (md.DYNAMIC_SPLITS, (3, t, 16, 512), (3, t, 16))
