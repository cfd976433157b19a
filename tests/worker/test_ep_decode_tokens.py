"""The token count an expert-parallel decode step declares (``decode_graphs.ep_decode_tokens``): the agreed count
rounded up to a decode graph size, or the count itself above the largest graph or without graphs. Every rank
computes it from the agreed count and the configured sizes alone, so their fixed-capacity collectives pair up."""

from __future__ import annotations

import pytest

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
