"""Contract emulation of the Ascend backend — it proves our use of the documented torch_npu contracts, not the
hardware.

A fake ``torch_npu`` (npu_emulation/: CPU implementations of exactly the fused ops backends/ascend calls, each
written from its documentation and checking argument order, layouts, dtypes and returned tuples) is injected,
and the whole engine runs through ``LLM(model, backend="ascend")`` on the CPU. Greedy tokens must equal the
CPU backend's (fp32, zero-overhead scheduling on, with and without MTP speculative decoding on the reference
model). NPU graphs (``enable_graphs=True``) are emulated by recording the captured device work and re-executing it
on replay, with FIA's host lengths re-issued through the emulated ``graph_task_update_begin/end`` before each replay
(npu_emulation/graphs.py). Nothing here says anything about NPU kernels, graph capture on the chip, bf16 numerics
on the chip, or speed.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import REFERENCE_MODEL_DIR
from parity_tests.npu_emulation import CALLS, emulated_npu
from tests.model.tiny_models import make_hf_model, save_hf
from tests.reference_assets import HAS_REFERENCE_MODEL, NO_REFERENCE_MODEL

FUSED = {
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_interleave_rope",
    "npu_fused_infer_attention_score",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_token_unpermute",
}
ID_PROMPTS = [
    list(range(1, 6)),
    [(7 * i + 3) % 90 + 1 for i in range(17)],
    [(11 * i + 5) % 90 + 1 for i in range(33)],
]


def _generate(model_dir, backend: str, prompts, max_tokens: int, **kw) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        backend=backend,
        dtype="float32",
        block_size=16,
        num_kv_blocks=96,
        zero_overhead_scheduling=True,
        **kw,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def small_v3(tmp_path_factory):
    """A random DeepSeek-V3 (sigmoid noaux_tc, 2 groups, q_lora) saved by transformers."""
    model = make_hf_model("v3", seed=3, n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True)
    return save_hf(model, str(tmp_path_factory.mktemp("small_v3")))


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    if not HAS_REFERENCE_MODEL:
        pytest.skip(NO_REFERENCE_MODEL)
    # A private copy: the reference model may be re-trained (rewritten) while the suite runs.
    dst = tmp_path_factory.mktemp("reference") / "model"
    shutil.copytree(REFERENCE_MODEL_DIR, dst)
    return dst


def test_small_v3_tokens_equal_cpu_and_fused_ops_are_used(small_v3):
    cpu = _generate(small_v3, "cpu", [{"prompt_token_ids": p} for p in ID_PROMPTS], 12)
    with emulated_npu():
        ascend = _generate(small_v3, "ascend", [{"prompt_token_ids": p} for p in ID_PROMPTS], 12)
        calls = dict(CALLS)
    assert ascend == cpu
    assert FUSED <= set(calls), f"fused ops never called: {FUSED - set(calls)}"


def test_reference_model_with_mtp_tokens_equal_cpu(reference_model):
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
    for spec in (None, "mtp"):
        kw = {"speculative_method": spec, "num_speculative_tokens": 3} if spec else {}
        cpu = _generate(reference_model, "cpu", prompts, 16, **kw)
        with emulated_npu():
            ascend = _generate(reference_model, "ascend", prompts, 16, **kw)
            assert CALLS["npu_fused_infer_attention_score"] > 0
        assert ascend == cpu, f"speculative_method={spec}"


def test_strict_a2_a3_profile_falls_back_with_reasons_and_still_matches(small_v3, monkeypatch):
    """The documented A2/A3 limits (fp16/bf16 only, 512/64 MLA dims, 256 experts) reject this small fp32
    model:
    every limited op must fall back, say why, and the tokens stay equal."""
    monkeypatch.setenv("DEEPINFER_ASCEND_PROFILE", "a2_a3")
    cpu = _generate(small_v3, "cpu", [{"prompt_token_ids": ID_PROMPTS[1]}], 6)
    with emulated_npu():
        llm = LLM(small_v3, backend="ascend", dtype="float32", block_size=16, num_kv_blocks=96)
        out = llm.generate(
            [{"prompt_token_ids": ID_PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
        )
        report = llm.llm_engine.backend.op_report()
        calls = dict(CALLS)
    assert [o.outputs[0].token_ids for o in out] == cpu
    assert report["profile"] == "a2_a3" and "not yet run on an NPU" in report["note"]
    for op in ("rope", "mla_attention", "moe_gating_topk", "grouped_mlp"):
        assert report[op].startswith("fallback ("), (op, report[op])
    assert "npu_fused_infer_attention_score" not in calls and "npu_moe_gating_top_k" not in calls
    assert report["rms_norm"].startswith("native")


def test_graph_capture_of_a_syncing_fallback_fails_and_decode_stays_eager(small_v3, monkeypatch):
    """On the strict A2/A3 profile this small model's attention falls back to the reference, which reads the
    lengths on the host: the emulated capture rejects that (as a real NPU capture would fail on the sync), the
    worker turns graphs off with the reason, and decoding continues eagerly with the CPU backend's tokens."""
    monkeypatch.setenv("DEEPINFER_ASCEND_PROFILE", "a2_a3")
    prompt = [{"prompt_token_ids": ID_PROMPTS[1]}]
    cpu = _generate(small_v3, "cpu", prompt, 6)
    with emulated_npu():
        llm = LLM(small_v3, backend="ascend", dtype="float32", block_size=16, num_kv_blocks=96, enable_graphs=True)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    assert [o.outputs[0].token_ids for o in out] == cpu
    assert stats["graph_steps"] == 0 and "NPU graph capture" in stats["graphs_disabled"], stats["graphs_disabled"]


def test_op_report_plan_for_deepseek_v3_dims_on_a2_a3(monkeypatch):
    """Full DeepSeek-V3 shapes in bf16 fit every documented limit the backend checks."""
    from deepinfer_npu.backends.ascend import capabilities as caps

    from deepinfer_npu.model_executor import DeepseekModelConfig

    cfg = DeepseekModelConfig.from_dict(
        {
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 3,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "max_position_embeddings": 4096,
        }
    )
    plan = caps.plan_for_config(caps.A2_A3, cfg, torch.bfloat16, 128)
    assert all(d.native for d in plan.values()), {k: d.report() for k, d in plan.items()}
    fp32 = caps.plan_for_config(caps.A2_A3, cfg, torch.float32, 128)
    assert not fp32["mla_attention"].native and "dtype" in fp32["mla_attention"].detail


def test_fia_split_into_16_query_pieces():
    from deepinfer_npu.backends.ascend.ops_mla import split_requests

    ends, kv, src, counts = split_requests([33, 1, 0, 16], [40, 9, 5, 16], 16)
    assert counts == [16, 16, 1, 1, 16] and src == [0, 0, 0, 1, 3]
    assert ends == [16, 32, 33, 34, 50] and kv == [23, 39, 40, 9, 16]


def test_backend_hooks_under_emulation():
    from deepinfer_npu.hal import get_backend
    from deepinfer_npu.hal.sync_guard import SyncForbiddenError

    with emulated_npu() as npu:
        be = get_backend("ascend")
        # the fake NPU is the host: its collectives run on gloo (the class names HCCL, what a real NPU runs)
        assert type(be).dist_backend == "hccl" and be.dist_backend == "gloo" and be.device == torch.device("cpu")
        free, total = be.memory_info()
        assert 0 < free <= total
        ev = be.create_event()
        with be.forbid_sync():
            assert npu.npu_namespace.sync_debug_mode == "error"
            ev.record()
            with pytest.raises(SyncForbiddenError):
                ev.synchronize()
        assert npu.npu_namespace.sync_debug_mode == 0
        runner = be.graph_runner()
        x = torch.zeros(4)
        out = runner.capture(4, lambda x: x * 2 + 1, {"x": x})
        x[:2].copy_(torch.tensor([1.0, 2.0]))  # the buffers' owner writes the inputs, the replay reads them
        assert torch.equal(runner.replay(4), torch.tensor([3.0, 5.0, 1.0, 1.0]))
        assert out.data_ptr() == runner.static_out[4].data_ptr() and runner.pick(3) == 4


# ---- ZOS: optimistic host key lengths, masked on the device (no host reads in the launch path) --------------
class _AscendHostReads:
    """Records host reads of tensor values (``item``/``tolist``/``bool``/boolean indexing, ...) made inside
    ``forbid_sync()`` by code in backends/ascend/ itself. Reads inside the emulated torch_npu ops (they stand
    for device kernels) and in the CPU reference ops (fallbacks; the engine-level detector covers the rest)
    are not the Ascend backend's launch path and are not counted."""

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        from deepinfer_npu.hal import sync_guard

        reads = self.reads = []

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if sync_guard.sync_forbidden() and sync_guard._is_sync_call(func, args, kwargs):
                    frame = sys._getframe(1)
                    while frame is not None and (
                        "/torch/" in frame.f_code.co_filename or frame.f_code.co_filename.endswith("sync_guard.py")
                    ):
                        frame = frame.f_back
                    if frame is not None and "/backends/ascend/" in frame.f_code.co_filename:
                        reads.append((getattr(func, "__name__", str(func)), frame.f_code.co_filename, frame.f_lineno))
                return func(*args, **kwargs)

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _paged_case(q_lens, k_true, shortfall, block_size=16, lrank=16, rdim=8, heads=4, seed=0):
    """Random split-layout cache whose keys past each request's true length are garbage (huge values)."""
    from deepinfer_npu.backends.ascend import kv_layout

    g = torch.Generator().manual_seed(seed)
    k_host = [k + d for k, d in zip(k_true, shortfall)]
    nb_req = [-(-k // block_size) for k in k_host]
    num_blocks = 1 + sum(nb_req)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(q_lens), max(nb_req), dtype=torch.int32)
    at = 0
    for b, n in enumerate(nb_req):
        tables[b, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    hal = torch.randn(num_blocks, block_size, lrank + rdim, generator=g)
    for b, (k, kk) in enumerate(zip(k_true, k_host)):  # rejected-draft garbage between true and host length
        for pos in range(k, kk):
            hal[tables[b, pos // block_size], pos % block_size] = 50.0
    t = sum(q_lens)
    q = torch.randn(t, heads, lrank, generator=g)
    qr = torch.randn(t, heads, rdim, generator=g)
    sq = torch.tensor(q_lens, dtype=torch.int32)
    sk = torch.tensor(k_true, dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(sq, 0)
    return dict(q=q, qr=qr, hal=hal, split=kv_layout.from_hal_layout(hal, lrank, rdim), tables=tables, sq=sq,
                sk=sk, cu=cu, k_host=k_host)


@pytest.mark.parametrize(
    "q_lens,k_true,shortfall,bound",
    [
        ([3, 1, 5], [20, 9, 33], [2, 0, 4], None),  # window padding (no bound)
        ([5, 1, 13], [40, 17, 60], [4, 3, 1], 4),  # bound 4: 12-query pieces, the 13-query request splits
        ([1, 1], [5, 30], [3, 0], None),  # one-query rows: padded, so sparse_mode=3 with the mask
        ([2, 16], [18, 40], [0, 0], None),  # optimistic flag, but nothing rejected; a full 16-query request
    ],
)
def test_fia_hides_rejected_draft_keys_from_device_lengths(q_lens, k_true, shortfall, bound):
    from deepinfer_npu.backends.ascend import ops_mla
    from deepinfer_npu.backends.cpu import mla as ref

    from deepinfer_npu.model_executor.attention_metadata import HostLengths

    c = _paged_case(q_lens, k_true, shortfall)
    want = ref.mla_attention(c["q"], c["qr"], c["hal"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3)
    host = HostLengths(tuple(q_lens), tuple(c["k_host"]), False, max(q_lens), max(c["k_host"]))
    with emulated_npu():
        ops_mla.reset_stats()
        got = ops_mla.mla_attention_fia(c["q"], c["qr"], c["split"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3,
                                        16, host=host, shortfall_bound=bound)
        stats, dev = dict(ops_mla.STATS), ops_mla.device_stats()
        assert CALLS["npu_fused_infer_attention_score"] == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert stats == {"fia_inexact": 1}
    assert dev == {"rows_with_kv_shortfall": sum(d > 0 for d in shortfall), "shortfall_beyond_padding": 0}
    if any(shortfall):  # negative control: taking the host lengths as exact attends the garbage
        exact = HostLengths(tuple(q_lens), tuple(c["k_host"]), True, max(q_lens), max(c["k_host"]))
        with emulated_npu():
            bad = ops_mla.mla_attention_fia(c["q"], c["qr"], c["split"], c["tables"], c["sq"], c["sk"], c["cu"],
                                            0.3, 16, host=exact)
        assert not torch.allclose(bad, want, rtol=1e-2, atol=1e-2)


def test_fia_counts_a_shortfall_beyond_its_padding():
    from deepinfer_npu.backends.ascend import ops_mla

    from deepinfer_npu.model_executor.attention_metadata import HostLengths

    c = _paged_case([3], [20], [3])
    host = HostLengths((3,), tuple(c["k_host"]), False, 3, c["k_host"][0])
    with emulated_npu():
        ops_mla.reset_stats()
        ops_mla.mla_attention_fia(c["q"], c["qr"], c["split"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3, 16,
                                  host=host, shortfall_bound=2)
        assert ops_mla.device_stats()["shortfall_beyond_padding"] == 3


def test_no_host_lengths_in_the_launch_path_takes_the_sync_free_dense_path():
    from deepinfer_npu.backends.ascend import ops_mla
    from deepinfer_npu.backends.cpu import mla as ref

    from deepinfer_npu.hal.sync_guard import forbid_sync

    c = _paged_case([1, 1, 2], [7, 30, 12], [0, 0, 0])
    want = ref.mla_attention(c["q"], c["qr"], c["hal"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3)
    with emulated_npu():
        ops_mla.reset_stats()
        with forbid_sync(), _AscendHostReads() as reads:
            got = ops_mla.mla_attention_fia(c["q"], c["qr"], c["split"], c["tables"], c["sq"], c["sk"], c["cu"],
                                            0.3, 16, host=None)
        outside = ops_mla.mla_attention_fia(c["q"], c["qr"], c["split"], c["tables"], c["sq"], c["sk"], c["cu"],
                                            0.3, 16, host=None)
        stats = dict(ops_mla.STATS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outside, want, rtol=1e-4, atol=1e-4)
    assert reads.reads == []
    assert stats == {"dense_no_host": 1, "host_reads": 2, "fia_exact": 1}  # the read fallback only outside


def _run_engine(model_dir, backend, dtype, spec, prompts, max_tokens, fork_after_first=False, params=None, **kw):
    """Greedy (or ``params`` per prompt), ZOS on, varlen on, k=4; optionally fork request 0 right after its first
    token. ``kw``: engine arguments to add or override (``enable_graphs``, ``varlen_verification``)."""
    opts = dict(block_size=16, num_kv_blocks=128, zero_overhead_scheduling=True, varlen_verification=True,
                num_speculative_tokens=4, max_num_seqs=4)  # few graph sizes: a short varlen profile
    llm = LLM(str(model_dir), backend=backend, dtype=dtype, speculative_method=spec, **{**opts, **kw})
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if params else greedy)
    final, forked = {}, not fork_after_first
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not forked and out.request_id == "0" and out.outputs[0].token_ids:
                engine.fork_request("0", "0-fork")
                forked = True
            if out.finished:
                o = out.outputs[0]
                top = [[t for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if 1 <= lp.rank <= 5]
                       for d in o.logprobs]
                final[out.request_id] = (list(o.token_ids), top)
    assert forked
    engine.scheduler.check_invariants()
    return engine, final


ZOS_PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec", ["mtp", "dflash"])
def test_reference_model_zos_spec_varlen_fork_equal_cpu_without_host_reads(reference_model, spec, dtype):
    """ZOS + speculative decoding (k=4) + varlen + a fork right after the parent's first token, through the
    emulated Ascend backend: tokens equal the CPU backend's (fp32: identical; bf16: identical here too, else the
    logprobs-close rule), FIA ran with optimistic (inexact) host key lengths and really hid rejected-draft
    keys, and the Ascend launch path read nothing from the device."""
    from deepinfer_npu.backends.ascend import ops_mla

    from deepinfer_npu.parity import rules

    _, cpu = _run_engine(reference_model, "cpu", dtype, spec, ZOS_PROMPTS, 20, fork_after_first=True)
    with emulated_npu():
        ops_mla.reset_stats()
        with _AscendHostReads() as reads:
            engine, asc = _run_engine(reference_model, "ascend", dtype, spec, ZOS_PROMPTS, 20,
                                      fork_after_first=True)
        stats, dev = dict(ops_mla.STATS), ops_mla.device_stats()
        fia_calls = CALLS["npu_fused_infer_attention_score"]
        report = engine.backend.op_report()
    assert set(asc) == set(cpu) == {"0", "1", "2", "0-fork"}
    for rid in cpu:
        verdict = rules.compare_trace(dtype, {"tokens": asc[rid][0], "top": asc[rid][1]},
                                      {"tokens": cpu[rid][0], "top": cpu[rid][1]})
        assert verdict.ok, (rid, verdict.message)
        if dtype == "float32":
            assert asc[rid][0] == cpu[rid][0]
    assert asc["0-fork"][0] == asc["0"][0]  # greedy: the fork continues exactly like its parent
    assert engine.backend.supports_device_resplit is False and engine.stats["varlen_resplit_rows"] == 0
    assert report["mla_attention"].startswith("native (torch_npu.npu_fused_infer_attention_score")
    assert report["copy_kv_blocks"].startswith("native (")
    assert fia_calls > 0 and stats.get("fia_inexact", 0) > 0, stats
    assert dev["rows_with_kv_shortfall"] > 0 and dev["shortfall_beyond_padding"] == 0, dev
    assert stats.get("host_reads_in_launch_path", 0) == 0 and reads.reads == [], reads.reads
    # Every attention call carries host lengths (the MTP chain derives bounds from the main step's), so the
    # sync-free dense fallback for host-less calls is never taken.
    assert stats.get("dense_no_host", 0) == 0, stats


def test_fork_copies_blocks_in_the_split_layout(reference_model, monkeypatch):
    """The fork's copy-on-write goes through the Ascend kernel set's copy_kv_blocks (split layout)."""
    from deepinfer_npu.backends.ascend import kernels as ascend_kernels

    copied = []
    original = ascend_kernels.AscendKernelSet.copy_kv_blocks

    def spy(self, caches, src, dst):
        copied.append((len(caches), int(src.numel()), sum(c in self._split_caches for c in caches)))
        return original(self, caches, src, dst)

    monkeypatch.setattr(ascend_kernels.AscendKernelSet, "copy_kv_blocks", spy)
    with emulated_npu():
        _run_engine(reference_model, "ascend", "bfloat16", None, ZOS_PROMPTS[:1], 6, fork_after_first=True)
    nonempty = [c for c in copied if c[1] > 0]
    assert nonempty and all(n_split == n_caches for n_caches, _, n_split in nonempty), copied


# ---- NPU graphs: capture / replay emulated by recording device work; FIA host lengths re-issued per step ---------
def test_npu_graph_emulation_keeps_what_a_graph_keeps():
    """The emulated ``torch.npu.NPUGraph`` replays recorded device work, not the Python: device inputs flow in,
    host values of capture time stay baked, views alias the static storage; what a real capture rejects (host
    reads, data-dependent shapes) raises."""
    from parity_tests.npu_emulation import ContractError

    with emulated_npu() as npu:
        ns = npu.npu_namespace
        w, scale = torch.randn(6, 6), [2.0]
        x, idx = torch.randn(4, 6), torch.tensor([3, 1])

        def fn(x, idx):
            y = (x @ w) * scale[0]  # scale: a host value, baked at capture
            z = torch.zeros(4, 6).index_copy_(0, idx, y[:2])
            return {"z": z, "v": z.view(-1)[:5], "s": torch.softmax(y, -1)}

        g = ns.NPUGraph()
        with ns.graph(g):
            out = fn(x, idx)
        for _ in range(2):
            x.copy_(torch.randn(4, 6))
            idx.copy_(torch.randperm(4)[:2])
            g.replay()
            want = fn(x, idx)
            assert all(torch.allclose(out[k], want[k]) for k in want)
        scale[0] = 5.0
        g.replay()
        assert torch.allclose(out["s"], torch.softmax((x @ w) * 2.0, -1))  # still the captured 2.0
        for bad in (lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: t[t > 0], lambda t: t.tolist()):
            with pytest.raises(ContractError, match="NPU graph capture"), ns.graph(ns.NPUGraph()):
                bad(x)


class _AttentionGraph:
    """Static buffers of a decode graph of ``size`` tokens around the Ascend kernel set's ``mla_attention``, and
    one paged cache in the split layout that each step's case is loaded into (DecodeGraphs' padding convention:
    rows past the step are q = k = 1 on block 0)."""

    def __init__(self, size=16, width=8, blocks=200, lrank=16, rdim=8, heads=4):
        self.size, self.width, self.blocks, self.lrank, self.rdim = size, width, blocks, lrank, rdim
        self.static = {"q": torch.zeros(size, heads, lrank), "qr": torch.zeros(size, heads, rdim),
                       "sk": torch.ones(size, dtype=torch.int32),
                       "bt": torch.zeros(size, width, dtype=torch.int32)}
        self.cache = torch.zeros(blocks, 16, lrank + rdim)

    def fn(self, q, qr, sk, bt):
        from deepinfer_npu.backends.ascend import ops_mla

        return ops_mla.mla_attention_fia(q, qr, self.cache, bt, None, sk, None, 0.3, 16, host=None)

    def load(self, c, max_kv_shortfall):
        from deepinfer_npu.backends.ascend import kv_layout

        from deepinfer_npu.model_executor.attention_metadata import HostLengths

        hal = torch.zeros(self.blocks, 16, self.lrank + self.rdim)
        hal[: c["hal"].shape[0]] = c["hal"]
        self.cache.copy_(kv_layout.from_hal_layout(hal, self.lrank, self.rdim))
        q_lens, b = c["sq"].tolist(), c["sq"].numel()
        t = sum(q_lens)
        st = self.static
        st["q"].zero_()
        st["q"][:t] = c["q"]
        st["qr"].zero_()
        st["qr"][:t] = c["qr"]
        st["sk"].zero_()
        st["sk"][:b] = c["sk"]
        st["sk"][b : b + self.size - t] = 1
        st["bt"].zero_()
        st["bt"][:b, : c["tables"].shape[1]] = c["tables"]
        exact = c["k_host"] == c["sk"].tolist()
        return HostLengths(tuple(q_lens), tuple(c["k_host"]), exact, max(q_lens), max(c["k_host"]),
                           None if exact else max_kv_shortfall)


GRAPH_STEPS = [  # (q lengths, true key lengths, shortfall = optimistic host - true) of successive decode steps
    ([3, 1, 5], [20, 9, 33], [2, 0, 4]),
    ([5, 5], [40, 17], [4, 3]),
    ([2, 4, 1, 5], [18, 40, 3, 22], [1, 3, 0, 4]),
    ([1, 1, 1], [5, 30, 7], [0, 0, 0]),  # exact host lengths
]


def test_npu_graph_fia_host_lengths_reissued_per_step_with_negative_controls():
    """One captured graph replayed for four different steps: before each replay the runner re-issues the FIA
    task with the step's host lists (graph_task_update_begin/end) and refreshes the device metadata; outputs equal
    the reference attention on the true lengths (rejected-draft keys hidden on the device). Negative controls: a
    replay without the update would block (the captured ExternalEvent wait); re-issuing the capture-time lists
    attends the wrong keys; an update may not swap tensors."""
    from deepinfer_npu.backends.ascend import ops_mla
    from deepinfer_npu.backends.cpu import mla as ref
    from parity_tests.npu_emulation import ContractError

    from deepinfer_npu.hal import get_backend

    with emulated_npu() as npu:
        runner = get_backend("ascend").graph_runner()
        ag = _AttentionGraph()
        ops_mla.reset_stats()
        cases = [_paged_case(*step, seed=i) for i, step in enumerate(GRAPH_STEPS)]
        for c in cases:
            runner.set_step_host_lengths(ag.size, ag.load(c, 4), 4)
            if not runner.has(ag.size):
                runner.capture(ag.size, ag.fn, ag.static)
            got = runner.replay(ag.size)[: c["q"].shape[0]]
            want = ref.mla_attention(c["q"], c["qr"], c["hal"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        dev, graph = ops_mla.device_stats(), runner.graphs[ag.size]
        short = [sum(d > 0 for d in step[2]) for step in GRAPH_STEPS]  # step 0 also ran at warm-up and capture
        assert dev == {"rows_with_kv_shortfall": 2 * short[0] + sum(short), "shortfall_beyond_padding": 0}
        assert runner.num_task_updates == npu.npu_namespace.task_updates == len(cases)
        assert graph.num_replays == len(cases) and CALLS["npu_fused_infer_attention_score.out"] == 1 + len(cases)

        state = runner.fia[ag.size]
        runner.set_step_host_lengths(ag.size, ag.load(cases[0], 4), 4)
        with pytest.raises(ContractError, match="ExternalEvent"):
            graph.replay()  # the runner's task update skipped
        stale = ops_mla.plan_fia  # re-issue the lists of step 0 for step 1's data
        runner.set_step_host_lengths(ag.size, ag.load(cases[0], 4), 4)
        lists0 = (list(state.plan.ends), list(state.plan.kv_lens))
        runner.set_step_host_lengths(ag.size, ag.load(cases[1], 4), 4)
        state.plan.ends, state.plan.kv_lens = lists0
        got = runner.replay(ag.size)[: cases[1]["q"].shape[0]]
        c = cases[1]
        want = ref.mla_attention(c["q"], c["qr"], c["hal"], c["tables"], c["sq"], c["sk"], c["cu"], 0.3)
        assert stale is ops_mla.plan_fia and not torch.allclose(got, want, rtol=1e-2, atol=1e-2)
        task, ns = state.tasks[0], npu.npu_namespace
        stream = ns.Stream()
        with ns.stream(stream), pytest.raises(ContractError, match="tensor arguments must be the captured"):
            ns.graph_task_update_begin(stream, task.handle)
            npu.npu_fused_infer_attention_score.out(task.args[0].clone(), *task.args[1:], **task.kwargs)


@pytest.mark.parametrize("spec", [None, "mtp", "dflash"])
def test_reference_model_npu_graphs_zos_equal_cpu_without_host_reads(reference_model, spec):
    """``enable_graphs=True`` on the emulated Ascend backend: decode steps replay captured NPU graphs (the worker
    really uses the Ascend runner), every replay first re-issues FIA's host lengths, and with ZOS, varlen,
    speculative decoding (k=4) and a fork the tokens equal the CPU backend's (fp32). Rejected-draft keys were hidden
    inside replays (with DFlash every main-model decode attention is a replay), nothing beyond the padding, and the
    Ascend launch path read nothing from the device. Verified by emulation only: no NPU graph has been captured."""
    from deepinfer_npu.backends.ascend import ops_mla
    from deepinfer_npu.backends.ascend.graph import NpuGraphRunner

    _, cpu = _run_engine(reference_model, "cpu", "float32", spec, ZOS_PROMPTS, 20, fork_after_first=True)
    with emulated_npu() as npu:
        ops_mla.reset_stats()
        with _AscendHostReads() as reads:
            engine, asc = _run_engine(reference_model, "ascend", "float32", spec, ZOS_PROMPTS, 20,
                                      fork_after_first=True, enable_graphs=True)
        stats, dev = engine.get_stats(), ops_mla.device_stats()
        runner = engine.worker.graphs.graphs
        updates, report = npu.npu_namespace.task_updates, engine.backend.op_report()
    assert {rid: asc[rid][0] for rid in asc} == {rid: cpu[rid][0] for rid in cpu}
    assert isinstance(runner, NpuGraphRunner) and stats["graphs_disabled"] is None
    assert stats["graph_steps"] > 0 and runner.num_replays >= stats["graph_steps"]  # (+ varlen's profile runs)
    assert updates == runner.num_task_updates > 0
    # Varlen picks draft counts from measured step times: on a loaded host it may verify few or no drafts. Every
    # rejected draft makes ZOS's next (replayed) step plan past the true key length, which the replay must hide.
    rejected = stats.get("spec_draft_tokens", 0) - stats.get("spec_accepted_tokens", 0)
    assert dev["shortfall_beyond_padding"] == 0 and (rejected == 0 or dev["rows_with_kv_shortfall"] > 0), (dev, stats)
    assert reads.reads == []
    assert "verified by the CPU contract emulation only" in report["decode_graphs"]


def _force_host_c_tilelang(monkeypatch) -> list:
    """Make the start-up probe say "usable" and build the kernels for the host C target; returns the list the
    backend's TileLangAscendKernels instance lands in."""
    from deepinfer_npu.backends.ascend import tilelang_ascend

    real = tilelang_ascend.TileLangAscendKernels
    made = []

    def host_c(target="ascend"):
        made.append(real("c"))
        return made[-1]

    monkeypatch.setattr(tilelang_ascend, "probe", lambda: tilelang_ascend.Probe(True, "forced (test)"))
    monkeypatch.setattr(tilelang_ascend, "TileLangAscendKernels", host_c)
    return made


@pytest.mark.tilelang
def test_reference_model_with_tilelang_kernels_host_c_build_equal_cpu(reference_model, monkeypatch):
    """The TileLang-Ascend wiring, end to end: with the kernels forced usable and built for the host C target
    (the same kernels_ascend programs; on an NPU they would be built by bisheng), zos_fixup and spec_verify
    of the emulated Ascend backend run on them, and greedy and seeded sampled tokens (MTP, ZOS) equal the CPU
    backend's.
    Varlen is off: the CPU backend re-splits drafts on the device and Ascend does not, which changes how many
    drafts are verified and so the random draws of sampled rows (greedy tokens are equal either way). On this
    machine the real decision is a fallback (tests/ascend/test_tilelang_ascend.py); the all-greedy kernel
    (spec_verify_greedy) is checked there against the reference."""
    made = _force_host_c_tilelang(monkeypatch)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True, logprobs=5)]
    kw = dict(params=params, varlen_verification=False)
    _, cpu = _run_engine(reference_model, "cpu", "float32", "mtp", ZOS_PROMPTS[:2], 16, **kw)
    with emulated_npu():
        engine, asc = _run_engine(reference_model, "ascend", "float32", "mtp", ZOS_PROMPTS[:2], 16, **kw)
        report = engine.backend.op_report()
    assert {r: v[0] for r, v in asc.items()} == {r: v[0] for r, v in cpu.items()}
    assert report["zos_fixup"].startswith("native (TileLang-Ascend") and "host C build" in report["zos_fixup"]
    calls = made[-1].calls
    assert calls.get("zos_seqlens_k", 0) > 0 and calls.get("rejection_accept", 0) > 0, calls
    assert calls.get("sample_pieces.build_gumbel_argmax", 0) > 0, calls  # bonus / residual draws and sample
    assert report["spec_verify"].startswith("native (TileLang-Ascend") and "sample" not in report


@pytest.mark.tilelang
def test_reference_model_gating_and_sampling_on_tilelang_host_c_build_equal_cpu(reference_model, monkeypatch):
    """On the strict A2/A3 profile the reference model's gating (8 experts, topk_group 1) does not fit
    npu_moe_gating_top_k: with the kernels forced usable (host C build), it runs on kernels_ascend.gating_topk and
    sampling on kernels_ascend.sample_pieces, and greedy, seeded-random and top-k / top-p rows (with logprobs) give
    the CPU backend's tokens."""
    monkeypatch.setenv("DEEPINFER_ASCEND_PROFILE", "a2_a3")
    made = _force_host_c_tilelang(monkeypatch)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.7, seed=8, top_k=20, top_p=0.9, max_tokens=8, ignore_eos=True, logprobs=5)]
    kw = dict(params=params, varlen_verification=False)
    _, cpu = _run_engine(reference_model, "cpu", "float32", None, ZOS_PROMPTS, 8, **kw)
    with emulated_npu():
        engine, asc = _run_engine(reference_model, "ascend", "float32", None, ZOS_PROMPTS, 8, **kw)
        report = engine.backend.op_report()
    assert asc == cpu
    assert report["moe_gating_topk"].startswith("native (TileLang-Ascend kernels_ascend.gating_topk (npu_moe_gating"), (
        report["moe_gating_topk"])
    calls = made[-1].calls
    assert calls.get("gating_topk", 0) > 0 and calls.get("sample_pieces.build_gumbel_argmax", 0) > 0, calls
    assert "npu_moe_gating_top_k" not in CALLS
