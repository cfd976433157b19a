"""Decode graphs under expert parallelism, the rules: the token count a decode step declares
(``decode_graphs.ep_decode_tokens``: the agreed count rounded up to a decode graph size, or the count itself above the
largest graph or without graphs; every rank computes it from the agreed count and the configured sizes alone, so
their fixed-capacity collectives pair up), and which ranks keep graphs (``rank_worker``)."""

from __future__ import annotations

import logging

import pytest

from deepinfer_npu.backends.cpu.kernels import CpuKernelSet
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.distributed.rank_worker import _graphs_under_expert_parallel
from deepinfer_npu.hal.graph_sizes import graph_sizes
from deepinfer_npu.worker.decode_graphs import ep_decode_tokens


def test_rounds_up_to_the_graph_size():
    sizes = graph_sizes(20, interval=8)
    assert sizes == [1, 2, 4, 8, 16, 20]
    got = {t: ep_decode_tokens(t, sizes) for t in range(1, 21)}
    assert got[1] == 1 and got[3] == 4 and got[5] == 8 and got[8] == 8 and got[9] == 16 and got[17] == 20
    # each is the smallest size >= t, i.e. the graph DecodeGraphs.size_for picks for that many tokens
    assert all(got[t] == min(s for s in sizes if s >= t) for t in got)


def test_above_the_largest_graph_or_without_graphs_the_count_itself():
    sizes = [1, 2, 4, 8]
    assert ep_decode_tokens(9, sizes) == 9 and ep_decode_tokens(300, sizes) == 300
    assert ep_decode_tokens(3, None) == 3 and ep_decode_tokens(3, []) == 3
    assert ep_decode_tokens(0, sizes) == 0


@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_bad_counts_are_named(bad):
    with pytest.raises(ValueError, match="agreed_tokens"):
        ep_decode_tokens(bad, [1, 2])


class _HostSizedKernels:
    """A kernel set without ``FixedCapacityAtDecode``: its dispatch sizes the all-to-all from host counts."""


def test_graphs_kept_under_ep_only_with_a_fixed_capacity_dispatch_and_without_eplb(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer_npu.distributed.rank_worker")
    config = EngineConfig(enable_graphs=True)
    kept = _graphs_under_expert_parallel(0, config, CpuKernelSet())
    assert kept.enable_graphs is True and kept.graph_capture == "startup"  # every rank, same sizes, same order
    assert "decode graphs on under expert parallelism" in caplog.text
    off = _graphs_under_expert_parallel(0, config, _HostSizedKernels())
    assert off.enable_graphs is False and "_HostSizedKernels" in caplog.text
    eplb = _graphs_under_expert_parallel(0, EngineConfig(enable_graphs=True, enable_eplb=True, data_parallel_size=2), CpuKernelSet())
    assert eplb.enable_graphs is False and "EPLB" in caplog.text
