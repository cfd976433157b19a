"""BlockManager: unit tests and Hypothesis state machines (KV blocks and state slots)."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer_npu import _core as C


def test_fresh_pool_order_and_reserved_zero():
    m = C.BlockManager(6)
    assert m.num_blocks == 6 and m.num_allocatable == 5 and m.num_free == 5
    assert m.free_list() == [1, 2, 3, 4, 5]
    assert m.ref_count(0) == 0 and m.usage() == 0.0


def test_allocate_head_free_tail():
    m = C.BlockManager(5)
    a, b = m.allocate(), m.allocate()
    assert (a, b) == (1, 2)
    m.free(a)
    assert m.free_list() == [3, 4, 1]  # freed id goes to the tail
    assert m.allocate() == 3  # allocation from the head
    assert m.usage() == pytest.approx(1 - 2 / 4)


def test_exhaustion_and_errors():
    m = C.BlockManager(3)
    m.allocate()
    m.allocate()
    assert not m.can_allocate(1) and m.can_allocate(0)
    with pytest.raises(RuntimeError, match="exhausted"):
        m.allocate()
    with pytest.raises(ValueError, match="reserved"):
        m.free(0)
    with pytest.raises(ValueError, match="out of range"):
        m.free(3)
    m.free(1)
    with pytest.raises(ValueError, match="not held"):
        m.free(1)
    with pytest.raises(ValueError, match="not held"):
        m.pin(1)
    with pytest.raises(ValueError):
        C.BlockManager(1)


def test_pin_ref_counts():
    m = C.BlockManager(4)
    b = m.allocate()
    m.pin(b)
    m.pin(b)
    assert m.ref_count(b) == 3
    m.free(b)
    m.free(b)
    assert m.num_free == 2 and m.ref_count(b) == 1
    m.free(b)
    assert m.num_free == 3 and m.free_list()[-1] == b
    assert m.check() == ""


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / pin / free against a model of holders."""

    num_blocks = 9

    def __init__(self):
        super().__init__()
        self.m = C.BlockManager(self.num_blocks)
        self.refs: dict[int, int] = {}
        self.model_free = list(range(1, self.num_blocks))

    @rule()
    def allocate(self):
        if not self.model_free:
            with pytest.raises(RuntimeError):
                self.m.allocate()
            return
        b = self.m.allocate()
        assert b == self.model_free.pop(0)  # head of the free list
        assert b != 0
        self.refs[b] = 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def pin(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.m.pin(b)
        self.refs[b] += 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(self.refs)))
        self.m.free(b)
        self.refs[b] -= 1
        if self.refs[b] == 0:
            del self.refs[b]
            self.model_free.append(b)  # to the tail

    @rule(b=st.integers(min_value=-2, max_value=12))
    def bad_free(self, b):
        if b in self.refs:
            return
        with pytest.raises(ValueError):
            self.m.free(b)

    @invariant()
    def consistent(self):
        assert self.m.check() == ""
        assert self.m.free_list() == self.model_free
        assert 0 not in self.m.free_list() and self.m.ref_count(0) == 0
        referenced = sum(1 for b in range(1, self.num_blocks) if self.m.ref_count(b) > 0)
        assert self.m.num_free + referenced == self.m.num_allocatable
        for b in range(1, self.num_blocks):
            assert self.m.ref_count(b) == self.refs.get(b, 0)
        assert self.m.usage() == pytest.approx(1 - self.m.num_free / self.m.num_allocatable)


class StateSlotMachine(BlockManagerMachine):
    """The state-slot manager: same class, sized floor(max_num_seqs * ratio) + 1 with slot 0 a dummy."""

    @initialize(max_num_seqs=st.integers(1, 12), ratio=st.sampled_from([1.0, 1.2, 1.5, 2.0]))
    def size_from_config(self, max_num_seqs, ratio):
        cfg = C.SchedulerConfig(
            max_model_len=64, num_kv_blocks=4, max_num_seqs=max_num_seqs, state_slot_ratio=ratio
        )
        n = cfg.num_state_slots
        assert n == math.floor(max_num_seqs * ratio) + 1
        self.num_blocks = n
        self.m = C.BlockManager(n)
        self.model_free = list(range(1, n))
        self.refs = {}


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStateSlotMachine = StateSlotMachine.TestCase
TestStateSlotMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
