"""``DecodeGraphs._fill``: a step like the last one (same graph size, tokens, rows and hook slots) rewrites only its
real rows and leaves the padding the last fill wrote; the buffers a graph reads must then equal a full fill into
fresh buffers, whatever sequence of steps came before (sizes, batch and table width changing, a capture in between).
CPU tensors; the buffers are the ones ``DecodeGraphs`` allocates."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from deepinfer_npu.model_executor.attention_metadata import AttentionMetadata
from deepinfer_npu.worker.decode_graphs import DecodeGraphs

SIZES, MAX, WIDTH = [1, 2, 4, 8, 16], 16, 6


def _graphs(hook: bool) -> DecodeGraphs:
    g = object.__new__(DecodeGraphs)
    i32, i64 = torch.int32, torch.int64
    g.buf = {"input_ids": torch.zeros(MAX, dtype=i64), "positions": torch.zeros(MAX, dtype=i64),
             "slot_mapping": torch.full((MAX,), -1, dtype=i64), "seqlens_q": torch.ones(MAX, dtype=i32),
             "seqlens_k": torch.ones(MAX, dtype=i32), "cu_seqlens_q": torch.arange(MAX + 1, dtype=i32),
             "block_tables": torch.zeros(MAX, WIDTH, dtype=i32)}
    if hook:
        g.buf["slots_per_token"] = torch.zeros(MAX, dtype=i64)
    g._arange = torch.arange(MAX + 1, dtype=torch.int32)
    g._filled = None
    g.sizes, g.disabled, g.k = SIZES, None, 1
    g.graphs = SimpleNamespace(has=lambda size: False, set_step_host_lengths=lambda *a: None,
                               capture=lambda *a: None)  # a capture that only reads the buffers
    return g


def _step(rng: random.Random, rows: int, q: int, width: int):
    seqlens_q = torch.full((rows,), q, dtype=torch.int32)
    seqlens_k = torch.tensor([rng.randint(q, width * 4) for _ in range(rows)], dtype=torch.int32)
    t = rows * q
    attn = AttentionMetadata(seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                             cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32) * q,
                             block_tables=torch.randint(1, 100, (rows, width), dtype=torch.int32),
                             slot_mapping=torch.randint(64, 6400, (t,)), positions=torch.randint(0, 256, (t,)),
                             max_seqlen_q=q, max_seqlen_k=width * 4, is_prefill=False)
    return torch.randint(1, 1000, (t,)), attn


def test_fills_that_skip_unchanged_padding_equal_full_fills():
    rng = random.Random(0)
    for hook in (False, True):
        g = _graphs(hook)
        rows, q, width = 3, 2, 2
        for i in range(300):
            r = rng.random()  # mostly steady steps, sometimes another batch, table width or a capture
            if r < 0.1:
                rows, q = rng.randint(1, 8), rng.randint(1, 2)
            elif r < 0.25:
                width = max(1, min(WIDTH, width + rng.choice((-1, 1))))
            elif r < 0.28:
                g.capture_all()  # writes all-padding inputs into every size's buffers
            ids, attn = _step(rng, rows, q, width)
            t = attn.num_tokens
            size = next(s for s in SIZES if s >= t)
            spt = None if (hook and rng.random() < 0.2) else torch.randint(1, 9, (t,))
            g._fill(size, ids, attn, spt)
            fresh = _graphs(hook)
            fresh._fill(size, ids, attn, spt)
            for name, buf in g._static(size).items():
                assert torch.equal(buf, fresh._static(size)[name]), (i, name, size, rows, q, width)


def test_a_steady_step_writes_only_its_real_rows():
    g = _graphs(hook=False)
    rng = random.Random(1)
    ids, attn = _step(rng, 3, 1, 2)
    g._fill(4, ids, attn)
    g.buf["input_ids"][3] = 5  # a padding token id the next fill must leave alone (it skips the padding)
    ids, attn = _step(rng, 3, 1, 2)
    g._fill(4, ids, attn)
    assert int(g.buf["input_ids"][3]) == 5 and torch.equal(g.buf["input_ids"][:3], ids)
