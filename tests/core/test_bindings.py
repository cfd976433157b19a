"""Boundary behaviour of deepinfer_npu._core: config validation, argument validation, ScheduleOutput views."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from tests.core.scheduler_driver import make_cfg, make_sched, prefill_all

from deepinfer_npu import _core as C


def test_config_defaults_and_derived():
    cfg = C.SchedulerConfig()
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, cfg.nextn) == (256, 8192, 64, 0)
    assert cfg.prefill_attempt_interval == 70 and cfg.prefill_any_attempt_interval == 100
    assert cfg.stop_preempted_request and cfg.enable_chunked_prefill and cfg.chunk_alignment == 1
    assert cfg.state_slot_ratio == pytest.approx(1.2) and cfg.prefill_kv_usage_threshold == pytest.approx(0.9)
    assert cfg.num_state_slots == 256 * 12 // 10 + 1
    cfg.max_model_len, cfg.num_kv_blocks = 1000, 10
    cfg.validate()
    assert cfg.max_blocks_per_seq == 16
    assert "max_model_len=1000" in repr(cfg)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(num_kv_blocks=1), "num_kv_blocks must be >= 2"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(block_size=0), "block_size"),
        (dict(nextn=-1), "nextn"),
        (dict(state_slot_ratio=0.0), "state_slot_ratio"),
        (dict(prefill_kv_usage_threshold=1.5), "prefill_kv_usage_threshold"),
        (
            dict(chunk_alignment=1000, max_num_batched_tokens=512),
            r"chunk_alignment must be in \[1, max_num_batched_tokens=512\]",
        ),
        (dict(prefill_attempt_interval=0), "prefill_attempt_interval"),
    ],
)
def test_config_validation_names_parameter(kw, match):
    cfg = make_cfg(**kw)
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    with pytest.raises(ValueError, match=match):
        C.Scheduler(cfg)


def test_update_argument_validation():
    s = make_sched()
    s.add_seq(0, [1, 2], 8)
    s.schedule(True)
    with pytest.raises(TypeError, match="num_new_tokens"):
        s.update(np.array([0]), np.array([1.0]), np.array([3], np.int32))
    with pytest.raises(ValueError, match="seq_ids must be 1-D"):
        s.update(np.array([[0]]), np.array([1]), np.array([3]))
    with pytest.raises(ValueError, match="num_new_tokens has 2 entries"):
        s.update(np.array([0]), np.array([1, 0]), np.array([3]))
    with pytest.raises(ValueError, match="new_token_ids"):
        s.update(np.array([0]), np.array([1]), np.array([-5]))
    with pytest.raises(TypeError, match="seq_ids"):
        s.update("abc", [1], [3])
    s.update(np.array([0], np.int32), np.array([1], np.int64), [3])  # other integer dtypes are accepted
    assert s.get_seq_status(0) == C.SeqStatus.PROMPTED


def test_set_draft_probs_and_varlen_validation():
    s = make_sched(nextn=2)
    with pytest.raises(ValueError, match="probs must be finite and in"):
        s.set_draft_probs([0], np.array([[0.5, np.nan]], np.float32))
    with pytest.raises(ValueError, match="probs has 1 rows"):
        s.set_draft_probs([0, 1], np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="step_ms"):
        s.configure_varlen([1, 2], [1.0, -1.0])
    with pytest.raises(ValueError, match="slope_ms_per_token"):
        s.set_runtime_estimates(-1.0, 0.0)
    assert not s.varlen_enabled
    s.configure_varlen([1, 2, 4], [1.0, 1.1, 1.3])
    assert s.varlen_enabled
    s0 = make_sched(nextn=0)
    s0.configure_varlen([1, 2], [1.0, 1.0])
    assert not s0.varlen_enabled  # varlen needs nextn > 0


def test_schedule_output_views_are_read_only_typed_and_keep_scheduler_alive():
    s = make_sched(max_model_len=100, block_size=16)
    s.add_seq(0, [1, 2, 3], 8)
    out = s.schedule(True)
    assert out.seq_ids.dtype == np.int64 and out.seqlens_q.dtype == np.int32
    assert out.is_last_chunk.dtype == np.bool_ and out.block_tables.shape == (1, 7)
    assert out.clone_blocks.shape == (0, 2) and out.zero_states.shape == (1,)
    assert not out.seq_ids.flags.writeable
    with pytest.raises(ValueError):
        out.block_tables[0, 0] = 5
    ids = out.seq_ids
    del s
    gc.collect()
    assert ids.tolist() == [0] and out.input_ids.tolist() == [1, 2, 3]


def test_stale_output_refuses_access():
    s = make_sched()
    s.add_seq(0, [1, 2, 3], 8)
    out = s.schedule(True)
    assert not out.is_stale
    s.schedule(False)
    assert out.is_stale and out.num_seqs == 1 and out.finished == []
    with pytest.raises(ValueError, match="stale"):
        _ = out.seq_ids


def test_block_table_padding_is_zero_after_shrink():
    s = make_sched(block_size=4, max_model_len=64)
    s.add_seq(0, list(range(1, 30)), 8)
    s.add_seq(1, [1], 8)
    out = s.schedule(True)
    assert (out.block_tables[0, :8] > 0).all()
    s.update(out.seq_ids, [1, 1], [1, 1])
    s.abort(0)
    out = s.schedule(False)
    assert out.block_tables[0].tolist()[1:] == [0] * 15  # row 0 previously held 8 blocks


def test_managers_are_read_only_views():
    s = make_sched()
    kv = s.kv_block_manager
    assert kv.num_free == 63 and not hasattr(kv, "allocate")
    assert s.state_manager.num_allocatable == s.config.num_state_slots - 1


def test_schedule_releases_the_gil():
    import threading

    s = make_sched(max_num_seqs=64, num_kv_blocks=4096, max_num_batched_tokens=8192)
    for i in range(64):
        s.add_seq(i, [1] * 100, 1000)
    prefill_all(s)
    stop = threading.Event()
    ticks = []

    def other():
        while not stop.is_set():
            ticks.append(1)

    t = threading.Thread(target=other)
    t.start()
    for _ in range(200):
        s.schedule(False)
    stop.set()
    t.join()
    assert ticks
