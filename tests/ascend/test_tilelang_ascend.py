"""The TileLang-Ascend kernels (kernels_ascend/) are wired into the Ascend kernel set behind a once-per-process
decision: on this machine (no NPU, no CANN bisheng, tilelang without its Ascend build) it must come out
"fallback (reason)" with the reason in the op report; the compositions around the kernels are checked against the
reference ops with the same programs built for the host C target (nothing here runs on an NPU): zos_fixup and
spec_verify (all outputs equal, seeded sampled rows included) and gating outside npu_moe_gating_top_k's limits
(ids equal per row, weights within kernels_ascend.gating_topk's fp32 tolerance)."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest
import torch
from deepinfer_npu.backends.ascend import capabilities as caps
from deepinfer_npu.backends.ascend import tilelang_ascend
from deepinfer_npu.backends.ascend.kernels import AscendKernelSet
from deepinfer_npu.backends.cpu import moe as ref_moe
from deepinfer_npu.backends.cpu import spec_verify as ref_verify
from deepinfer_npu.backends.cpu import zos as ref_zos

from deepinfer_npu import SamplingParams
from deepinfer_npu.hal.types import GatingParams
from deepinfer_npu.sampling import SamplingTensors

#: Outside npu_moe_gating_top_k's A2/A3 limits: 384 experts (Kimi-K2-like V3 routing).
WIDE_V3 = GatingParams(top_k=8, num_experts=384, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
                       topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
#: Inside them (DeepSeek-V3 itself): the fused op serves it.
V3 = GatingParams(top_k=8, num_experts=256, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                  norm_topk_prob=True, routed_scaling_factor=2.5)


def test_decision_on_this_machine_is_fallback_with_reason():
    probe = tilelang_ascend.probe()
    assert not probe.usable
    assert "no NPU" in probe.reason  # no torch_npu / device here (the emulation also counts as no NPU)
    if tilelang_ascend._find_bisheng() is None:
        assert "bisheng" in probe.reason and "BISHENG_HOME" in probe.reason
    ks = AscendKernelSet()
    ks.setup_tilelang()
    assert ks.tilelang is None
    report = ks.op_report()
    for op in ("zos_fixup", "spec_verify"):
        assert report[op].startswith("fallback (TileLang-Ascend kernels_ascend."), report[op]
        assert probe.reason in report[op] and "torch composition" in report[op]
    assert "sample" not in report  # the engine samples through spec_verify
    assert "emulation only" in report["decode_graphs"]


def test_gating_outside_the_fused_op_falls_back_to_the_reference_with_both_reasons():
    """On A2/A3, 384 experts do not fit npu_moe_gating_top_k; without the TileLang path the reference runs and the
    report names both reasons. (The fused op's own path needs torch_npu: not called here.)"""
    probe = tilelang_ascend.probe()
    ks = AscendKernelSet(caps.A2_A3)
    ks.setup_tilelang()
    logits, bias = torch.randn(5, 384), torch.randn(384) * 0.1
    got = ks.moe_gating_topk(logits, bias, WIDE_V3)
    want = ref_moe.moe_gating_topk(logits, bias, WIDE_V3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    rep = ks.op_report()["moe_gating_topk"]
    assert rep.startswith("fallback (npu_moe_gating_top_k does not fit: 384 experts"), rep
    assert f"kernels_ascend.gating_topk not usable here: {probe.reason}" in rep and "reference composition" in rep


def test_probe_names_each_missing_piece(monkeypatch, tmp_path):
    """A fake bisheng + ld.lld on BISHENG_HOME removes that reason; what else is missing is still named."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bisheng", "ld.lld"):
        path = bin_dir / tool
        path.write_text("#!/bin/sh\nexit 1\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("BISHENG_HOME", str(tmp_path))
    probe = tilelang_ascend.probe()
    assert not probe.usable and "no NPU" in probe.reason
    assert "bisheng (CANN's AscendC compiler" not in probe.reason and "ld.lld" not in probe.reason
    assert tilelang_ascend._find_bisheng() == os.path.join(str(tmp_path), "bin", "bisheng")
    monkeypatch.setattr(tilelang_ascend, "_spec", lambda name: name != "tilelang")
    assert "tilelang is not installed" in tilelang_ascend.probe().reason


def test_forced_usable_decision_reports_native():
    ks = AscendKernelSet(caps.A2_A3)
    ks.setup_tilelang(tilelang_ascend.Probe(True, "forced"), tilelang_ascend.TileLangAscendKernels("c"))
    report = ks.op_report()
    assert report["spec_verify"] == (
        "native (TileLang-Ascend kernels_ascend.spec_verify_greedy (all-greedy batches) / rejection_accept (sampled "
        "rows) + sample_pieces (argmax, acceptance uniforms, bonus / residual Gumbel draws) (host C build: tests "
        "only))")
    # Gating: the fused op where it fits, the kernel outside its limits, the reference where the kernel declines.
    assert ks._gating_decision(V3, True).report() == "native (torch_npu.npu_moe_gating_top_k)"
    wide = ks._gating_decision(WIDE_V3, True)
    assert wide.tilelang and wide.report() == (
        "native (TileLang-Ascend kernels_ascend.gating_topk (npu_moe_gating_top_k does not fit: 384 experts (takes "
        "(256,)), 384 experts (max 256)) (host C build: tests only))")
    tiny = replace(WIDE_V3, num_experts=8, n_group=8, topk_group=4, top_k=2)  # one expert per group: no top-2 sum
    d = ks._gating_decision(tiny, True)
    assert not d.native and not d.tilelang and "gating_topk does not take it (noaux_tc with fewer than 2" in d.detail


# ---- the compositions around the kernels, on the host C build of the same programs ------------------------------
@pytest.fixture(scope="module")
def host_c_kernels():
    pytest.importorskip("tilelang", reason="tilelang is not installed (pip install tilelang==0.1.15)")
    return tilelang_ascend.TileLangAscendKernels("c")


@pytest.mark.parametrize("seed", [0, 1])
def test_zos_fixup_on_kernels_equals_reference(host_c_kernels, seed):
    g = torch.Generator().manual_seed(seed)
    b, s, k = 9, 13, 4
    sq = torch.randint(1, k + 2, (b,), generator=g).to(torch.int32)
    sk = sq + torch.randint(5, 60, (b,), generator=g).to(torch.int32)
    opt = torch.randint(0, 2, (b,), generator=g).bool()
    slots = torch.randperm(s, generator=g)[:b]
    corr = torch.randint(0, k, (s,), generator=g)
    probs = torch.rand(s, k, generator=g)
    probs[::3] = 1.0  # ties
    caps = torch.randint(0, k + 1, (b,), generator=g)
    for extra in ((), (probs, caps)):
        got = host_c_kernels.zos_fixup(sq, sk, opt, slots, corr, *extra)
        want = ref_zos.zos_fixup(sq, sk, opt, slots, corr, *extra)
        assert all(torch.equal(a, w) for a, w in zip(got, want))


def _verify_case(seed: int, temps: list[float]):
    g = torch.Generator().manual_seed(seed)
    vocab, rows = 60, len(temps)
    q = torch.randint(1, 6, (rows,), generator=g)
    row = torch.repeat_interleave(torch.arange(rows), q)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)])
    j = torch.arange(row.numel()) - cu[row]
    logits = torch.randn(row.numel(), vocab, generator=g) * 3
    draft = torch.where(torch.rand(row.numel(), generator=g) < 0.6, logits.argmax(-1),
                        torch.randint(0, vocab, (row.numel(),), generator=g))
    draft[cu[1:] - 1] = -1  # no draft after a row's last token
    params = [SamplingParams(temperature=t, seed=5 + i, top_k=8 if i % 3 == 1 else -1,
                             top_p=0.9 if i % 3 == 2 else 1.0) for i, t in enumerate(temps)]
    t = SamplingTensors.from_params(params, [5 + i for i in range(rows)], [0] * rows, vocab_size=vocab)
    fields = ("temperature", "top_k", "top_p", "is_greedy", "seeds", "offsets")
    t = replace(t, **{f: getattr(t, f).index_select(0, row) for f in fields})
    t.offsets, t.max_num_logprobs = j + 3, 3
    ban = torch.zeros(row.numel(), vocab, dtype=torch.bool)
    ban[:, 7] = True
    return logits, draft, row, j, rows, 6, t, ban


@pytest.mark.parametrize("temps", [[0.0] * 6, [0.0, 0.8, 1.0, 0.0, 0.7, 1.3]])
def test_spec_verify_on_kernels_equals_reference(host_c_kernels, temps):
    """All greedy (spec_verify_greedy) and mixed greedy / sampled rows (rejection_accept): every output equals the
    reference's (target tokens where they are defined: up to each row's first rejection)."""
    before = dict(host_c_kernels.calls)
    for seed in range(3):
        args = _verify_case(seed, temps)
        got, want = host_c_kernels.spec_verify(*args), ref_verify.spec_verify(*args)
        row, j = args[2], args[3]
        live = j <= want.accepted[row]
        assert torch.equal(got.emitted, want.emitted) and torch.equal(got.accepted, want.accepted)
        assert torch.equal(got.num_emitted, want.num_emitted)
        assert torch.equal(got.target_tokens[live], want.target_tokens[live])
        assert torch.equal(got.logprobs.top_ids[live], want.logprobs.top_ids[live])
        assert torch.equal(got.logprobs.sampled_logprob[live], want.logprobs.sampled_logprob[live])
    kernel = "spec_verify_greedy" if all(x == 0 for x in temps) else "rejection_accept"
    assert host_c_kernels.calls.get(kernel, 0) == before.get(kernel, 0) + 3


def test_npu_build_path_lowers_and_stops_at_bisheng(host_c_kernels, monkeypatch):
    """The (never executed) NPU path compiles with ``tilelang.compile(..., target="ascend")``: here it lowers and
    generates code, then stops where CANN's bisheng compiler is needed."""
    if tilelang_ascend._find_bisheng() is not None:
        pytest.skip("bisheng is installed here")
    monkeypatch.delenv("BISHENG_HOME", raising=False)
    with pytest.raises(RuntimeError, match="bisheng"):
        tilelang_ascend.TileLangAscendKernels("ascend")._kernel("zos_seqlens_k", "build")


# ---- gating on the host C build ----------------------------------------------------------------------------------
def test_gating_on_kernels_equals_reference(host_c_kernels):
    """Configurations npu_moe_gating_top_k rejects on A2/A3 run on kernels_ascend.gating_topk through the kernel set:
    the ids equal the reference's per token (the op's choice order is unspecified) and the weights are within the
    kernel's stated fp32 tolerance."""
    from deepinfer_npu.kernels_ascend.gating_topk import WEIGHT_ATOL, WEIGHT_RTOL, by_id

    ks = AscendKernelSet(caps.A2_A3)
    ks.setup_tilelang(tilelang_ascend.Probe(True, "forced"), host_c_kernels)
    g = torch.Generator().manual_seed(0)
    cases = [
        (WIDE_V3, True),
        (replace(V3, topk_group=3), True),  # k_group 3: A2/A3 takes 4
        (V3, False),  # no correction bias (required by the fused op on A2/A3)
        (GatingParams(top_k=6, num_experts=160, scoring_func="softmax", topk_method="group_limited_greedy",
                      n_group=8, topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0), False),  # V2
    ]
    for params, has_bias in cases:
        before = host_c_kernels.calls.get("gating_topk", 0)
        e = params.num_experts
        bias = torch.randn(e, generator=g) * 0.1 if has_bias else None
        logits = torch.randn(24, e, generator=g) * 2
        w, ids = ks.moe_gating_topk(logits, bias, params)
        rw, rids = ref_moe.moe_gating_topk(logits, bias, params)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == rids.shape
        (w, ids), (rw, rids) = by_id(w, ids), by_id(rw, rids)
        assert torch.equal(ids, rids), params
        torch.testing.assert_close(w, rw, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        assert host_c_kernels.calls["gating_topk"] == before + 1
        assert ks.op_report()["moe_gating_topk"].startswith("native (TileLang-Ascend kernels_ascend.gating_topk")
