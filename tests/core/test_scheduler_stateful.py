"""Hypothesis RuleBasedStateMachine driving the Scheduler with random add / abort / fork / schedule / update /
finish / set_draft_probs, with up to two steps in flight (ZOS). Invariants checked after every rule:

* the C++ check_invariants(): free + referenced = total for both managers, ref counts = holders,
  block 0 / slot 0 never held, every sequence's blocks cover its committed tokens plus in-flight
  reservations, finished sequences hold nothing;
* budgets of every step (max_num_seqs, max_num_batched_tokens, max_num_prompts,
  prefill_max_sum_seqlen_k, a chunked request alone in its step), block tables cover seqlens_k and
  are zero-padded, no finished sequence is scheduled;
* after everything is finished or aborted, every block and slot is free.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from tests.core.scheduler_driver import snapshot
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer_npu import _core as C

FINISHED = {
    C.SeqStatus.FINISHED_STOPPED,
    C.SeqStatus.FINISHED_LENGTH,
    C.SeqStatus.FINISHED_ABORTED,
    C.SeqStatus.FINISHED_PREEMPTED,
    C.SeqStatus.FINISHED_IGNORED,
}


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_kv_blocks=st.one_of(st.integers(2, 12), st.integers(12, 60)),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.one_of(st.integers(1, 8), st.integers(8, 48)),
        max_model_len=st.one_of(st.integers(4, 16), st.integers(16, 64)),
        nextn=st.integers(0, 3),
        max_num_prompts=st.integers(0, 3),
        sum_k=st.sampled_from([0, 16, 40]),
        stop_preempted=st.booleans(),
        chunked=st.booleans(),
        align=st.sampled_from([1, 2, 4]),
        varlen=st.booleans(),
        ratio=st.sampled_from([1.0, 1.2, 2.0]),
    )
    def setup(
        self,
        block_size,
        num_kv_blocks,
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len,
        nextn,
        max_num_prompts,
        sum_k,
        stop_preempted,
        chunked,
        align,
        varlen,
        ratio,
    ):
        self.cfg = C.SchedulerConfig(
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, align),
            max_model_len=max_model_len,
            nextn=nextn,
            max_num_prompts=max_num_prompts,
            prefill_max_sum_seqlen_k=sum_k,
            stop_preempted_request=stop_preempted,
            enable_chunked_prefill=chunked,
            chunk_alignment=align,
            state_slot_ratio=ratio,
            prefill_attempt_interval=3,
            prefill_any_attempt_interval=5,
        )
        self.s = C.Scheduler(self.cfg)
        if varlen and nextn:
            sizes = [1, 2, 4, 8, 16, 32, 48]
            self.s.configure_varlen(sizes, [1.0 + 0.05 * g for g in sizes])
            self.s.set_runtime_estimates(0.01, 0.1)
        self.next_id = 0
        self.ids: list[int] = []
        self.finished: set[int] = set()
        self.pending: list[dict] = []  # steps scheduled but not yet updated, oldest first
        self.max_new: dict[int, int] = {}

    # -------------------------------------------------------------- state queries
    def _status(self, sid):
        return self.s.get_seq_status(sid)

    def _live(self):
        return [i for i in self.ids if i not in self.finished]

    def _mark_finished(self, sid):
        self.finished.add(sid)

    # -------------------------------------------------------------- rules
    @rule(n=st.one_of(st.integers(1, 12), st.integers(1, 70)), max_new=st.integers(1, 20))
    def add(self, n, max_new):
        sid = self.next_id
        self.next_id += 1
        self.s.add_seq(sid, list(range(1, n + 1)), max_new)
        self.ids.append(sid)
        self.max_new[sid] = max_new

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def abort(self, data):
        sid = data.draw(st.sampled_from(self.ids))
        was_live = sid not in self.finished
        assert self.s.abort(sid) == was_live
        self._mark_finished(sid)
        assert self._status(sid) in FINISHED

    @precondition(lambda self: self._live())
    @rule(data=st.data(), stop=st.booleans())
    def finish(self, data, stop):
        sid = data.draw(st.sampled_from(self._live()))
        if self._status(sid) not in (C.SeqStatus.PROMPTED, C.SeqStatus.RUNNING):
            return
        assert self.s.finish(sid, C.SeqStatus.FINISHED_STOPPED if stop else C.SeqStatus.FINISHED_LENGTH)
        self._mark_finished(sid)

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live()))
        if self._status(parent) not in (C.SeqStatus.PROMPTED, C.SeqStatus.RUNNING):
            return
        child = self.next_id
        self.next_id += 1
        self.s.fork_seq(parent, child)
        self.ids.append(child)
        self.max_new[child] = self.max_new[parent]

    @precondition(lambda self: self._live() and self.cfg.nextn > 0)
    @rule(data=st.data())
    def draft_probs(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.ids), min_size=1, max_size=4, unique=True))
        probs = data.draw(
            st.lists(
                st.floats(0, 1, width=32),
                min_size=len(ids) * self.cfg.nextn,
                max_size=len(ids) * self.cfg.nextn,
            )
        )
        self.s.set_draft_probs(ids, np.array(probs, np.float32).reshape(len(ids), self.cfg.nextn))

    @precondition(
        lambda self: len(self.pending) < 2 and not any(p["kind"] == C.StepKind.PREFILL for p in self.pending)
    )
    @rule(mode=st.sampled_from(["vote", "prefill", "decode"]))
    def schedule(self, mode):
        do_prefill = {"vote": self.s.prefill_vote() != 0, "prefill": True, "decode": False}[mode]
        out = snapshot(self.s.schedule(do_prefill))
        self._check_step(out, do_prefill)
        for sid, status, reason in out["finished"]:
            assert status in (C.SeqStatus.FINISHED_IGNORED, C.SeqStatus.FINISHED_PREEMPTED) and reason
            self._mark_finished(int(sid))
        if out["num_seqs"]:
            self.pending.append(out)

    @precondition(
        lambda self: len(self.pending) < 2 and not any(p["kind"] == C.StepKind.PREFILL for p in self.pending)
    )
    @rule(data=st.data(), zos=st.booleans())
    def engine_step(self, data, zos):
        """What the engine does: vote, schedule (round two on an empty prefill), then apply results.

        Under ZOS a decode step stays in flight until the next one is scheduled."""
        vote = self.s.prefill_vote()
        n_before = len(self.pending)
        self.schedule("prefill" if vote != 0 else "decode")
        if vote != 0 and len(self.pending) == n_before:  # round two: nobody prefilled anything
            self.schedule("decode")
        keep = 1 if zos and self.pending and self.pending[-1]["kind"] == C.StepKind.DECODE else 0
        while len(self.pending) > keep:
            self.update(data)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def update(self, data):
        step = self.pending.pop(0)
        ids = step["seq_ids"]
        if step["kind"] == C.StepKind.PREFILL:
            counts = step["is_last_chunk"].astype(np.int32)
        else:
            counts = np.array([data.draw(st.integers(0, int(d))) + 1 for d in step["num_drafts"]], np.int32)
        toks = np.array(
            data.draw(st.lists(st.integers(0, 1000), min_size=int(counts.sum()), max_size=int(counts.sum()))),
            np.int32,
        )
        before = {}
        for sid in ids.tolist():
            if sid not in self.finished:
                before[sid] = len(self.s.seq_info(sid)["tokens"])
        self.s.update(ids, counts, toks)
        for sid, c in zip(ids.tolist(), counts.tolist()):
            if sid in before:
                info = self.s.seq_info(sid)
                assert len(info["tokens"]) == before[sid] + c  # exactly what Python sent
                assert len(info["tokens"]) - info["num_prompt_tokens"] <= self.max_new[sid]
                assert len(info["tokens"]) <= self.cfg.max_model_len + 1
                out_len = len(info["tokens"]) - info["num_prompt_tokens"]
                done = out_len >= self.max_new[sid] or len(info["tokens"]) >= self.cfg.max_model_len
                if done and info["status"] in (C.SeqStatus.PROMPTED, C.SeqStatus.RUNNING):
                    # the engine's stop check (FINISHED_LENGTH), as Python would do after post-processing
                    assert self.s.finish(sid, C.SeqStatus.FINISHED_LENGTH)
                    self._mark_finished(sid)

    # -------------------------------------------------------------- checks
    def _check_step(self, out, do_prefill):
        cfg = self.cfg
        n = out["num_seqs"]
        assert out["num_tokens"] == int(out["seqlens_q"].sum()) == len(out["input_ids"])
        assert out["num_tokens"] <= cfg.max_num_batched_tokens
        assert len(set(out["seq_ids"].tolist())) == n
        for sid in out["seq_ids"].tolist():
            assert sid not in self.finished, f"finished seq {sid} scheduled"
            assert self._status(sid) not in FINISHED
        bt = out["block_tables"]
        assert bt.shape == (n, cfg.max_blocks_per_seq)
        for i in range(n):
            row = bt[i].tolist()
            k = sum(1 for b in row if b != 0)
            assert all(b != 0 for b in row[:k]) and all(b == 0 for b in row[k:])  # 0-padded
            assert k * cfg.block_size >= out["seqlens_k"][i]
            assert out["state_slots"][i] != 0
            assert out["seqlens_k"][i] <= cfg.max_model_len
        assert all(b != 0 for pair in out["clone_blocks"].tolist() for b in pair)
        assert all(x != 0 for pair in out["clone_states"].tolist() for x in pair)
        if do_prefill:
            assert out["kind"] == C.StepKind.PREFILL
            max_prompts = cfg.max_num_prompts or cfg.max_num_seqs
            assert n <= max_prompts
            assert (out["num_drafts"] == 0).all()
            if not out["is_last_chunk"].all():
                assert n == 1  # a chunked request runs alone
            if cfg.prefill_max_sum_seqlen_k and n > 1:
                assert int(out["seqlens_k"].sum()) <= cfg.prefill_max_sum_seqlen_k
            assert len(out["zero_states"]) <= n
        else:
            assert out["kind"] in (C.StepKind.DECODE, C.StepKind.EMPTY)
            assert n <= cfg.max_num_seqs
            assert (out["seqlens_q"] == out["num_drafts"] + 1).all()
            assert (out["num_drafts"] <= cfg.nextn).all() and out["is_last_chunk"].all()
            assert len(out["zero_states"]) == 0
            opt = out["seqlens_k"] - out["seqlens_q"]
            assert (np.diff(opt) <= 0).all()  # sorted by total length, descending

    @invariant()
    def invariants(self):
        if hasattr(self, "s"):
            self.s.check_invariants()

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for sid in self.ids:
            self.s.abort(sid)
        self.s.check_invariants()
        assert not self.s.has_unfinished()
        assert self.s.kv_block_manager.num_free == self.s.kv_block_manager.num_allocatable
        assert self.s.state_manager.num_free == self.s.state_manager.num_allocatable
        # results of steps still in flight are ignored once everything finished
        for step in self.pending:
            ids = step["seq_ids"]
            counts = step["is_last_chunk"].astype(np.int32)
            self.s.update(ids, counts, np.zeros(int(counts.sum()), np.int32))
        self.s.check_invariants()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=400, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_long_random_run_with_natural_completion():
    """A longer seeded run: Python-side finishes at max_new_tokens, ZOS with one step in flight, forks."""
    rng = np.random.default_rng(7)
    for stop_preempted in (True, False):
        cfg = C.SchedulerConfig(
            max_model_len=96,
            num_kv_blocks=48,
            block_size=4,
            max_num_seqs=6,
            nextn=2,
            max_num_batched_tokens=40,
            stop_preempted_request=stop_preempted,
        )
        s = C.Scheduler(cfg)
        max_new = {}
        next_id = 0
        pending = []
        for _ in range(1500):
            if rng.random() < 0.15 and next_id < 120:
                s.add_seq(next_id, list(rng.integers(0, 50, rng.integers(1, 40))), int(rng.integers(1, 30)))
                max_new[next_id] = s.seq_info(next_id)["max_new_tokens"]
                next_id += 1
            vote = s.prefill_vote()
            out = s.schedule(vote != 0)
            if vote != 0 and out.num_seqs == 0:
                out = s.schedule(False)
            snap = snapshot(out)
            if snap["kind"] == C.StepKind.PREFILL:
                for p in pending:  # prefill is post-processed at once, after the previous decode step
                    s.update(*_results(p, rng))
                pending = []
                if snap["num_seqs"]:
                    s.update(*_results(snap, rng))
            else:
                if len(pending) == 1:
                    s.update(*_results(pending.pop(), rng))
                if snap["num_seqs"]:
                    pending.append(snap)
            for sid in list(max_new):
                try:
                    info = s.seq_info(sid)
                except KeyError:
                    max_new.pop(sid)
                    continue
                if (
                    len(info["tokens"]) - info["num_prompt_tokens"] >= max_new[sid]
                    or len(info["tokens"]) >= 96
                ):
                    s.finish(sid, C.SeqStatus.FINISHED_LENGTH)
                    max_new.pop(sid)
                elif info["status"] == C.SeqStatus.RUNNING and rng.random() < 0.01:
                    s.fork_seq(sid, 10_000 + next_id)
                    next_id += 1
            s.check_invariants()
        for p in pending:
            s.update(*_results(p, rng))
        for sid in range(20_000):
            s.abort(sid)
        assert s.kv_block_manager.num_free == s.kv_block_manager.num_allocatable
        assert s.state_manager.num_free == s.state_manager.num_allocatable


def _results(snap, rng):
    ids = snap["seq_ids"]
    if snap["kind"] == C.StepKind.PREFILL:
        counts = snap["is_last_chunk"].astype(np.int32)
    else:
        counts = np.array([int(rng.integers(0, d + 1)) + 1 for d in snap["num_drafts"]], np.int32)
    return ids, counts, rng.integers(0, 50, int(counts.sum())).astype(np.int32)
