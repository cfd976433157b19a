"""Captured-graph replay of decode steps (worker/decode_graphs.py), exercised on the CPU reference backend with
the ``EagerReplayRunner`` injected: greedy tokens are identical to eager runs for {no speculation, MTP, DFlash} x
{ZOS on, off}, with batches that are not graph sizes (padding) and an abort mid-flight; the replay path is really
taken, and padding tokens write nothing outside block 0."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepinfer_npu import LLM, SamplingParams
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.hal.graph_runner import EagerReplayRunner, GraphRunner
from deepinfer_npu.worker.decode_graphs import DecodeGraphs
from tests.reference_assets import CODE_PROMPTS as PROMPTS  # 5 rows: a decode step of 5 pads to a graph of 8
from tests.reference_assets import SPEC_METHODS as METHODS
from tests.reference_assets import needs_reference_model

pytestmark = needs_reference_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SMALL_KV = dict(block_size=16, num_kv_blocks=64)  # small pool: the per-step KV snapshots stay cheap


@pytest.fixture
def padding_audit(monkeypatch):
    """Wrap ``DecodeGraphs.run``: after each replay, every changed KV row is a real token's slot or in block 0,
    and the padding rows of the static buffers point at block 0 and write nothing. -> counters."""
    stats = {"replays": 0, "padded": 0, "hook_replays": 0}
    orig = DecodeGraphs.run

    def run(self, size, ids, attn, slots_per_token=None):
        before = [c.clone() for c in self.runner.kv_caches]
        ring = getattr(getattr(self.drafter_hook, "__self__", None), "ring", None)  # DFlash's ring, in-graph hook
        ring_before = ring.clone() if ring is not None else None
        if self.drafter_hook is None:
            out = orig(self, size, ids, attn)
        else:  # no slots: varlen's start-up timing runs (a curve not in DEEPINFER_CACHE_DIR), all write slot 0
            out = orig(self, size, ids, attn, slots_per_token=slots_per_token)
        t, b = attn.num_tokens, attn.num_seqs
        st = self._static(size)
        if ring_before is not None:  # the hook wrote only real tokens' slots and the dummy slot 0
            assert bool((st["slots_per_token"][t:] == 0).all())
            changed_slots = set((ring_before != ring).flatten(1).any(-1).nonzero().flatten().tolist())
            real = set() if slots_per_token is None else set(slots_per_token.tolist())
            assert changed_slots <= real | {0}, changed_slots
            stats["hook_replays"] += slots_per_token is not None
        assert bool((st["slot_mapping"][t:] < 0).all())
        assert bool((st["block_tables"][b:] == 0).all())
        assert int(st["seqlens_q"].sum()) == size and int(st["cu_seqlens_q"][-1]) == size
        assert bool((st["seqlens_k"][b:] <= 1).all())  # padding rows read at most slot 0 of block 0
        bs = self.runner.block_size
        allowed = set(attn.slot_mapping.tolist()) | set(range(bs))
        for old, new in zip(before, self.runner.kv_caches):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) <= allowed, sorted(set(changed) - allowed)
        stats["replays"] += 1
        stats["padded"] += int(size > t)
        return out

    monkeypatch.setattr(DecodeGraphs, "run", run)
    return stats


def _generate(method, zos, **kw):
    llm = LLM(speculative_method=method, num_speculative_tokens=4, zero_overhead_scheduling=zos, **SMALL_KV, **kw)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _generate_fixed_drafts(method, zos, **kw):
    """Every step verifies all drafts: varlen verification sizes drafts from measured times, so two runs of the
    same prompts on a loaded machine take different schedules and draft from different positions."""
    llm = LLM(speculative_method=method, num_speculative_tokens=4, zero_overhead_scheduling=zos,
              varlen_verification=False, **SMALL_KV, **kw)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method,zos", list(itertools.product(METHODS, [True, False])))
def test_graph_replay_matches_eager(graph_runners, padding_audit, method, zos):
    eager_llm, eager = _generate_fixed_drafts(method, zos)
    assert not graph_runners  # enable_graphs off: the worker never asks for a runner
    llm, graphed = _generate_fixed_drafts(method, zos, enable_graphs=True)
    assert graphed == eager
    worker = llm.llm_engine.worker
    runner = graph_runners[-1]
    assert worker.graphs is not None and worker.graphs.graphs is runner
    varlen = llm.llm_engine.varlen  # its start-up curve may time graph replays (not when loaded from the cache)
    profiled = varlen.profile_replays if varlen is not None else 0
    assert runner.num_replays == worker.graph_steps + profiled == padding_audit["replays"]
    assert worker.graph_steps > 0
    assert worker.graph_steps == llm.get_stats()["decode_steps"]  # every decode step replayed
    assert runner.num_captures == len(runner.static_out) <= len(worker.graphs.sizes)
    assert padding_audit["padded"] > 0  # batches that are not graph sizes were padded
    if method in ("dflash", "mtp"):  # the drafter's propose (MTP: its draft chain) replays graphs of its own
        pg = worker.drafter.propose_graphs
        assert pg is not None and pg.disabled is None and pg.replays > 0
        assert pg.graphs is not runner and pg.graphs.num_replays == pg.replays
    # Both runs verify every draft, so they draft from the same positions: acceptance may differ only where a
    # padded graph's arithmetic flips a near-tie in a draft (not in the target's tokens, compared above).
    if method is not None:
        got, want = (x.get_stats()["per_position_acceptance"] for x in (llm, eager_llm))
        assert len(got) == len(want)
    if method == "mtp":  # chain graphs on padded rows and wider tables draft as well as the eager chain
        assert all(g >= w - 0.05 for g, w in zip(got, want)), (got, want)
    if method == "dflash":
        # and its ring write (DFlash.capture) runs inside the decode graph, after the main forward
        assert worker.graphs.drafter_hook is not None
        assert padding_audit["hook_replays"] == worker.graph_steps
        # drafts from the in-graph ring write are as good as from the eager one (a wrong write loses acceptance)
        assert all(g >= w - 0.05 for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("zos", [True, False])
def test_abort_midflight_with_graphs(graph_runners, padding_audit, method, zos):
    _, eager = _generate(method, zos)
    llm = LLM(speculative_method=method, num_speculative_tokens=4, zero_overhead_scheduling=zos,
              enable_graphs=True, **SMALL_KV)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    final = {}
    for step in range(1000):
        if step == 4:
            engine.abort_request("1")
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert len(final["1"]) < len(eager[1])
    for i in (0, 2, 3, 4):
        assert final[str(i)] == eager[i]
    assert graph_runners[-1].num_replays > 0 and padding_audit["padded"] > 0
    engine.scheduler.check_invariants()


def test_startup_capture(graph_runners):
    _, eager = _generate("mtp", True, max_num_seqs=8)
    llm, graphed = _generate("mtp", True, max_num_seqs=8, enable_graphs=True, graph_capture="startup")
    runner, graphs = graph_runners[-1], llm.llm_engine.worker.graphs
    assert sorted(runner.static_out) == graphs.sizes and graphs.sizes[-1] == 8 * 5  # captured at start-up
    assert graphed == eager and runner.num_replays > 0


def test_no_runner_runs_eagerly():
    llm, _ = _generate(None, True, enable_graphs=True)  # the plain CPU backend has no graph runner
    assert llm.llm_engine.worker.graphs is None and llm.llm_engine.worker.graph_steps == 0


def test_eager_replay_runner_contract():
    runner = EagerReplayRunner()
    assert isinstance(runner, GraphRunner)
    x = torch.tensor([1.0, 2.0])
    out = runner.capture(2, lambda x: {"y": x * 2, "none": None}, {"x": x})
    x.copy_(torch.tensor([3.0, 4.0]))
    again = runner.replay(2)
    assert again is out and again["y"].tolist() == [6.0, 8.0] and again["none"] is None
    assert runner.has(2) and not runner.has(4) and runner.num_replays == 1


def test_graph_capture_validated():
    with pytest.raises(ValueError, match="graph_capture"):
        EngineConfig(graph_capture="always")


@pytest.mark.parametrize("method", METHODS)
def test_graph_path_reads_nothing_from_the_device(graph_runners, method):
    from deepinfer_npu.hal.sync_guard import HostReadDetector

    llm = LLM(speculative_method=method, num_speculative_tokens=4, enable_graphs=True, **SMALL_KV)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, min_tokens=4, logprobs=2)
    with HostReadDetector() as detector:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert detector.reads == []
    assert graph_runners[-1].num_replays > 0


def test_varlen_curve_profiled_from_graph_replays(graph_runners, monkeypatch, tmp_path):
    """With graphs on, varlen's start-up curve times the replay of each size's captured graph (seed §7.2), and
    its cache entry is kept apart from the eager curve's."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path))
    sizes_run: list[int] = []
    orig = DecodeGraphs.run

    def run(self, size, ids, attn):
        sizes_run.append(size)
        return orig(self, size, ids, attn)

    monkeypatch.setattr(DecodeGraphs, "run", run)
    llm = LLM(speculative_method="mtp", num_speculative_tokens=4, varlen_verification=True, max_num_seqs=4,
              enable_graphs=True, **SMALL_KV)
    varlen = llm.llm_engine.varlen
    assert varlen.graphs is llm.llm_engine.worker.graphs
    assert sorted(set(sizes_run)) == sorted(varlen.sizes)  # every size replayed ...
    assert len(sizes_run) == 6 * len(varlen.sizes) == varlen.profile_replays  # capture + 5 timed runs each
    assert all(llm.llm_engine.worker.graphs.graphs.has(s) for s in varlen.sizes)
    assert len(varlen.curve) == len(varlen.sizes) and all(ms > 0 for ms in varlen.curve)
    cached = list((tmp_path / "varlen").glob("*.json"))
    assert len(cached) == 1 and '"graphs": true' in cached[0].read_text()
    sizes_run.clear()
    eager = LLM(speculative_method="mtp", num_speculative_tokens=4, varlen_verification=True, max_num_seqs=4,
                **SMALL_KV)
    assert eager.llm_engine.varlen.graphs is None and not sizes_run
    assert len(list((tmp_path / "varlen").glob("*.json"))) == 2  # a separate cache entry


def test_propose_graphs_pad_and_fall_back():
    """ProposeGraphs: rows padded to the graph size with slot 0 / token 0 / position 0, outputs cut to the real
    rows; a capture that fails turns the graphs off (None: the caller proposes eagerly)."""
    from deepinfer_npu.spec.propose_graphs import ProposeGraphs

    seen = []

    def fn(golden, positions, slots):
        seen.append((golden.clone(), positions.clone(), slots.clone()))
        return torch.stack([golden, golden + 1], 1), torch.stack([positions, slots], 1).float()

    pg = ProposeGraphs(fn, EagerReplayRunner(), max_rows=8, device=torch.device("cpu"))
    g, p, s = torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]), torch.tensor([3, 1, 2])
    drafts, confs = pg.run(g, p, s)
    assert torch.equal(drafts, torch.stack([g, g + 1], 1)) and torch.equal(confs, torch.stack([p, s], 1).float())
    golden, positions, slots = seen[-1]
    assert golden.shape[0] == 4 and golden[3] == 0 and positions[3] == 0 and slots[3] == 0  # size 4, one pad row
    assert pg.run(torch.arange(9), torch.arange(9), torch.arange(9)) is None  # more rows than the largest size

    def broken(golden, positions, slots):
        raise RuntimeError("an op that syncs")

    pg = ProposeGraphs(broken, EagerReplayRunner(), max_rows=8, device=torch.device("cpu"))
    assert pg.run(g, p, s) is None and "an op that syncs" in pg.disabled
    assert pg.run(g, p, s) is None  # off for good


def test_mtp_chain_graphs_pad_rows_to_block_0_and_match_the_eager_chain(graph_runners):
    """MTP's draft chain from ProposeGraphs (3 rows -> graph size 4, tables narrower than the graph width; row 1's
    chain starts a block its table does not have, so it writes block 0 at slots 0 .. k - 2): the same drafts as
    the eager chain on the same inputs (the padding row writes block 0 from slot k - 1 on, clear of row 1), and
    the MTP cache changes only at the real rows' chain slots and in block 0."""
    from deepinfer_npu.model_executor.device_metadata import pad_block_tables
    from deepinfer_npu.spec.mtp_drafter import chain_graph_width

    llm = LLM(speculative_method="mtp", num_speculative_tokens=4, enable_graphs=True, **SMALL_KV)
    drafter = llm.llm_engine.worker.drafter
    pg, bs, k = drafter.propose_graphs, drafter.block_size, drafter.num_speculative_tokens
    assert pg is not None and pg.buf["tables"].shape[1] == chain_graph_width(drafter.max_model_len, k, bs)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, drafter.hidden_size, generator=g).to(drafter.dtype)
    pos = torch.tensor([5, 32, 30])  # row 1: position 32 is block column 2, a 0 (unallocated) in its table
    tables = torch.tensor([[3, 4, 0], [5, 6, 0], [7, 8, 9]], dtype=torch.int32)
    before = [c.clone() for c in drafter.kv_caches]
    drafts, confs = pg.run(h, pos, tables)
    assert drafts.shape == (3, k) and pg.replays == 1
    allowed = {int(tables[r, p // bs]) * bs + p % bs for r in range(3) for p in (int(pos[r]) + m for m in range(k - 1))}
    allowed |= set(range(bs))  # block 0: the padding row
    for old, new in zip(before, drafter.kv_caches):
        changed = set((old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist())
        assert changed <= allowed and changed, sorted(changed - allowed)
    eager_drafts, eager_confs = drafter._chain(h, pos, pad_block_tables(tables.long(), 64, bs), 64, None, None)
    assert torch.equal(drafts, eager_drafts)
    assert torch.allclose(confs, eager_confs, atol=1e-4)


def test_chain_graph_width_holds_the_decode_graph_tables_and_the_chain():
    """The chain graphs take the tables a graph-replayed step hands the drafter (DecodeGraphs' width) and the
    chain's own positions (keys up to max_model_len + 2k, then k + 1 more)."""
    import math

    from deepinfer_npu.spec.mtp_drafter import chain_graph_width

    for mml in (64, 65, 511, 512, 576, 4096):
        for k in (1, 3, 5, 15):
            for bs in (16, 64, 128):
                w = chain_graph_width(mml, k, bs)
                assert w >= math.ceil((mml + 2 * k) / bs) + 1  # worker/decode_graphs.py's width
                assert (mml + 2 * k + k) // bs < w  # the chain's last position has a column
