"""MLA on Ascend: composed prolog (native norms + rope + split-cache write) and the fused attention op.

Attention maps onto ``torch_npu.npu_fused_infer_attention_score`` in MLA mode — queries in the latent space
(TND layout, [T, N, L]) plus ``query_rope``; the paged caches as ``key``/``value`` (the latent is both) plus
``key_rope``; ``sparse_mode=3`` (causal aligned to the end of each request's keys) with the 2048x2048 mask it
requires. FIA takes at most 16 query tokens per request in this mode, so longer requests (prefill chunks,
many drafts) are split into pieces of <= 16 queries, each piece a pseudo-request whose key length ends at its
last query: causal attention of the whole request equals the union of its pieces.

The op's ``actual_seq_lengths(_kv)`` are host int lists; they come from ``AttentionMetadata.host``
(``HostLengths``), never from reading the device tensors in the launch path. Under zero-overhead scheduling the
host key lengths are the CPU's optimistic upper bounds; :func:`mla_attention_fia` hides the rejected-draft keys
beyond the true (device) length by shifting each request's queries on the device within padded query rows —
the only documented way, since FIA's MLA mode takes no custom mask (details in its docstring, docs/ascend.md).
Inside an NPU decode graph (``graph.py``) the same attention runs from static device buffers
(:func:`mla_attention_fia_graph`) and the host lists are re-issued per step with ``graph_task_update_begin/end``.

Doc: Ascend/pytorch docs torch_npu-npu_fused_infer_attention_score.md (hiascend Pytorch/700 ptaoplist_001232);
usage: vllm_ascend/attention/mla_v1.py ``_forward_decode`` (SpecDecoding branch: TND, sparse_mode=3,
``actual_seq_lengths`` = cumulative query ends, ``actual_seq_lengths_kv`` = per-request key lengths).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deepinfer_npu.hal import sync_guard
from deepinfer_npu.hal.types import MLAWeights, RopeLike

from . import kv_layout, runtime
from .ops_dense import rms_norm

#: sparse_mode=3 ("rightDownCausal") takes this fixed, compressed mask (doc: atten_mask 2048x2048, 1 = masked).
FIA_MASK_SIZE = 2048

#: Host-side launch bookkeeping (tests read it; :func:`reset_stats` clears it):
#: ``fia_exact`` / ``fia_inexact`` — FIA calls with exact / optimistic (ZOS upper-bound) host key lengths;
#: ``host_reads`` — calls without ``host`` lengths outside ``forbid_sync()`` that read the device length tensors
#: on the host (a sync on an NPU); ``host_reads_in_launch_path`` — the same inside ``forbid_sync()``: never done
#: (such a call takes the sync-free dense path instead), kept so tests can assert it stays 0;
#: ``dense_no_host`` — calls without ``host`` inside ``forbid_sync()`` served by :func:`mla_attention_dense`.
STATS: Counter[str] = Counter()
#: Device-side counters per device (no sync to update; tests read them): rows whose true key length was below
#: the host's optimistic one (rejected-draft keys hidden by the query shift) and rows whose shortfall exceeded
#: the padding the host planned (would have attended garbage; must stay 0).
_DEVICE_STATS: dict[tuple[str, int | None], torch.Tensor] = {}

_masks: dict[tuple[str, int | None], torch.Tensor] = {}

#: The NPU graph being warmed up or captured on this thread (``graph.FiaGraphState``), set by
#: ``graph.NpuGraphRunner.capture``: FIA calls then take :func:`mla_attention_fia_graph`.
_GRAPH = threading.local()


def enter_graph(state: Any) -> Any:
    previous = getattr(_GRAPH, "state", None)
    _GRAPH.state = state
    return previous


def exit_graph(previous: Any) -> None:
    _GRAPH.state = previous


def active_graph() -> Any:
    return getattr(_GRAPH, "state", None)


def reset_stats() -> None:
    STATS.clear()
    _DEVICE_STATS.clear()


def _device_counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _DEVICE_STATS:
        with torch.inference_mode(False):  # a normal tensor: updated both inside and outside inference mode
            _DEVICE_STATS[key] = torch.zeros(2, dtype=torch.int64, device=device)
    return _DEVICE_STATS[key]


def device_stats() -> dict[str, int]:
    """Sum of the device counters (reads device memory: tests and reports only, never the launch path)."""
    short = sum(int(t[0]) for t in _DEVICE_STATS.values())
    bad = sum(int(t[1]) for t in _DEVICE_STATS.values())
    return {"rows_with_kv_shortfall": short, "shortfall_beyond_padding": bad}


def _causal_mask(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _masks:
        _masks[key] = torch.triu(
            torch.ones(FIA_MASK_SIZE, FIA_MASK_SIZE, dtype=torch.bool, device=device), diagonal=1
        )
    return _masks[key]


def host_list(t: torch.Tensor, what: str) -> list[int]:
    """Read a device length tensor on the host — the fallback for callers that pass no ``host`` lengths, used
    only outside ``forbid_sync()`` (a device->host sync on an NPU). Counted in ``STATS``."""
    if sync_guard.sync_forbidden():  # not reached from mla_attention_fia (dense path); kept as a tripwire
        STATS["host_reads_in_launch_path"] += 1
        if t.device.type != "cpu":
            sync_guard.check_sync_allowed(f"{what}.tolist() for npu_fused_infer_attention_score")
    STATS["host_reads"] += 1
    return [int(v) for v in t.tolist()]


def mla_prolog(
    hidden: torch.Tensor,
    w: MLAWeights,
    positions: torch.Tensor,
    rope: RopeLike,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_fn,
    split_cache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HAL ``mla_prolog`` from native pieces: ``F.linear`` (aten matmul on the NPU), ``npu_rms_norm`` for
    q_a/kv_a norms, ``rope_fn`` (npu_interleave_rope / npu_rotary_mul or the reference), then the cache write
    into the split layout (``split_cache``) or the HAL layout.

    The single fused ``npu_mla_prolog_v2/_v3`` is not called: it needs FRACTAL_NZ weights (``npu_format_cast``
    at load; the HAL has no load hook yet), fixes He=7168/Hcq=1536/L=512/D=128/R=64, and writes k_rope in
    de-interleaved order while the HAL contract returns q_rope interleaved. Same for
    npu_kv_rmsnorm_rope_cache.
    Doc: torch_npu-npu_mla_prolog_v2.md, torch_npu-npu_kv_rmsnorm_rope_cache.md (Ascend/pytorch docs).
    """
    num_tokens = hidden.shape[0]
    nope, rdim, lrank = w.qk_nope_head_dim, w.qk_rope_head_dim, w.kv_lora_rank
    if w.q_proj is not None:
        q = F.linear(hidden, w.q_proj)
    else:
        q = F.linear(
            rms_norm(F.linear(hidden, w.q_a_proj, w.q_a_bias), w.q_a_layernorm, w.norm_eps), w.q_b_proj
        )
    q = q.view(num_tokens, w.num_heads, nope + rdim)
    q_nope, q_pe = q.split([nope, rdim], dim=-1)
    q_latent = torch.einsum("thn,hnl->thl", q_nope, w.w_uk)  # W_UK absorption (aten bmm on the NPU)
    q_rope = rope_fn(q_pe, positions, rope.cos_sin_cache, rope.interleaved)

    kv = F.linear(hidden, w.kv_a_proj, w.kv_a_bias)
    c_kv, k_pe = kv.split([lrank, rdim], dim=-1)
    c_kv = rms_norm(c_kv.contiguous(), w.kv_a_layernorm, w.norm_eps)
    k_pe = rope_fn(k_pe.unsqueeze(1), positions, rope.cos_sin_cache, rope.interleaved).squeeze(1)
    if split_cache:
        kv_layout.write_split(kv_cache, c_kv, k_pe, slot_mapping)
    else:
        from deepinfer_npu.backends.cpu.mla import write_kv_cache

        write_kv_cache(kv_cache, torch.cat((c_kv, k_pe), dim=-1), slot_mapping)
    return q_latent, q_rope


def split_requests(
    seqlens_q: list[int], seqlens_k: list[int], max_q: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Pieces of <= ``max_q`` queries: ``(cumulative query ends, key lengths, source request, query counts)``.

    Piece ``[s, e)`` of a request with ``q`` queries and ``k`` keys ends at position ``k - q + e - 1``, so its
    key length is ``k - q + e``; with causal masking aligned to the end of the keys (sparse_mode=3) each of its
    queries sees exactly what it sees in the whole request. Empty requests are dropped.
    """
    plan = plan_fia(seqlens_q, seqlens_k, max_q, exact=True)
    return plan.ends, plan.kv_lens, plan.src, plan.counts


@dataclass
class FiaPlan:
    """Host plan of one FIA call: one pseudo-request ("piece") per entry.

    A piece holds ``counts[p]`` true queries of request ``src[p]`` (its queries ``starts[p] ..
    starts[p] + counts[p] - 1``) in ``counts[p] + pads[p]`` FIA rows, with host key length ``kv_lens[p]``.
    ``dest[t]`` is the FIA row of true query token ``t`` when the request's true key length equals the host's
    (shortfall 0); a shortfall of ``d <= pads[p]`` moves the piece's queries ``d`` rows up (see
    :func:`mla_attention_fia`). ``piece_pad[t]`` / ``token_req[t]``: the pad and the request of token ``t``.
    """

    ends: list[int]
    kv_lens: list[int]
    src: list[int]
    counts: list[int]
    pads: list[int]
    starts: list[int]
    dest: list[int]
    piece_pad: list[int]
    token_req: list[int]

    @property
    def rows(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def padded(self) -> bool:
        return any(self.pads)


def plan_fia(
    seqlens_q: list[int] | tuple[int, ...],
    seqlens_k: list[int] | tuple[int, ...],
    max_q: int,
    exact: bool,
    shortfall_bound: int | None = None,
) -> FiaPlan:
    """Split requests into <= ``max_q``-row pieces; with inexact (optimistic) key lengths, pad every piece with
    query rows so the true queries can be shifted by the device-side shortfall (see :func:`mla_attention_fia`).

    Pads: ``min(bound, k - q)`` with a known shortfall bound (pieces then hold ``max_q - bound`` queries), else
    the rest of the ``max_q`` window; never more than ``k - q`` (the true key length is at least ``q``, so the
    shortfall is at most ``k - q``) and never past the window. Exact lengths: no pads.
    """
    ends, kv, src, counts, pads, starts = [], [], [], [], [], []
    dest, piece_pad, token_req = [], [], []
    if exact:
        piece = max_q
    elif shortfall_bound is not None:
        piece = max(1, max_q - shortfall_bound)
    else:
        piece = max_q
    total = 0
    for b, (q, k) in enumerate(zip(seqlens_q, seqlens_k)):
        for s in range(0, q, piece):
            e = min(q, s + piece)
            n = e - s
            if exact:
                pad = 0
            else:
                room = max_q - n
                pad = min(room, k - q) if shortfall_bound is None else min(shortfall_bound, room, k - q)
                pad = max(pad, 0)
            base = total
            total += n + pad
            ends.append(total)
            kv.append(k - q + e)
            src.append(b)
            counts.append(n)
            pads.append(pad)
            starts.append(s)
            dest.extend(range(base + pad, base + pad + n))
            piece_pad.extend([pad] * n)
            token_req.extend([b] * n)
    return FiaPlan(ends, kv, src, counts, pads, starts, dest, piece_pad, token_req)


def _host_lengths(host, seqlens_q: torch.Tensor, seqlens_k: torch.Tensor):
    if host is not None:
        return list(host.seqlens_q), list(host.seqlens_k), bool(host.seqlens_k_exact)
    return host_list(seqlens_q, "seqlens_q"), host_list(seqlens_k, "seqlens_k"), True


def mla_attention_fia(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    max_q_per_request: int,
    host=None,
    shortfall_bound: int | None = None,
) -> torch.Tensor:
    """HAL ``mla_attention`` through ``npu_fused_infer_attention_score`` over the split-layout cache.

    Host lengths: FIA takes ``actual_seq_lengths(_kv)`` as host int lists, so they come from ``host``
    (``HostLengths``: exact query lengths; exact key lengths, or the CPU's optimistic upper bounds under ZOS).
    Without ``host`` inside ``forbid_sync()`` (the MTP chain builds its metadata on the device) the call takes
    the sync-free :func:`mla_attention_dense`; outside it the device tensors are read (:func:`host_list`).

    ZOS (inexact key lengths), without a sync and without a custom mask: per request the host key length ``K``
    may exceed the true one ``k`` by ``d = K - k >= 0``; keys ``k .. K-1`` hold rejected-draft garbage. FIA's
    MLA mode accepts no custom ``atten_mask`` (only sparse_mode=3 with the fixed 2048x2048 causal mask, or
    sparse_mode=0 without a mask; doc constraints for query D=512 and for the TND layout), so instead each
    piece of ``n`` true queries gets ``pad`` extra query rows (host-planned, ``pad >= d``), and the device
    places true query ``j`` at row ``pad - d + j`` of the piece. sparse_mode=3 lets row ``r`` of a piece with
    ``n + pad`` rows and key length ``K - q + e`` see keys ``<= K - q + e - (n + pad) + r``; for
    ``r = pad - d + (j - s)`` that is ``k - q + j`` — exactly the true position of query ``j``, so it sees its
    own and earlier keys and never the garbage beyond ``k``. Pad rows hold zero queries; their outputs are
    dropped. The row index is a device tensor (``host dest - d``), so nothing is read back. A shortfall beyond
    the pad (which a correct bound rules out) is clamped and counted on the device (:func:`device_stats`).
    """
    graph = active_graph()
    if graph is not None:
        return mla_attention_fia_graph(graph, q_latent, q_rope, kv_cache, block_tables, seqlens_k, softmax_scale)
    num_tokens, num_heads, lrank = q_latent.shape
    rdim = q_rope.shape[-1]
    out = torch.zeros_like(q_latent)
    if num_tokens == 0:
        return out
    if host is None and sync_guard.sync_forbidden():
        STATS["dense_no_host"] += 1
        return mla_attention_dense(
            q_latent, q_rope, kv_cache, block_tables, seqlens_q, seqlens_k, cu_seqlens_q, softmax_scale
        )
    q_lens, k_lens, exact = _host_lengths(host, seqlens_q, seqlens_k)
    bound = getattr(host, "max_kv_shortfall", None)
    if bound is None:
        bound = shortfall_bound
    plan = plan_fia(q_lens, k_lens, max_q_per_request, exact, bound)
    if not plan.ends:
        return out
    STATS["fia_exact" if exact else "fia_inexact"] += 1
    device = q_latent.device
    n_real = len(plan.dest)
    if plan.src == list(range(len(q_lens))):
        tables = block_tables
    else:
        tables = block_tables.index_select(0, torch.tensor(plan.src, dtype=torch.long).to(device))
    if not plan.padded:  # rows are the true queries, in order
        query = q_latent[:n_real].contiguous()
        query_rope = q_rope[:n_real].contiguous()
        dest = None
    else:
        # Device-side shift: d = host K - true k per request (int64 on the device; never read back).
        k_host = torch.tensor(k_lens, dtype=torch.int64).to(device)
        short = k_host - seqlens_k.to(torch.int64)
        tok_req = torch.tensor(plan.token_req, dtype=torch.int64).to(device)
        pad_tok = torch.tensor(plan.piece_pad, dtype=torch.int64).to(device)
        d_tok = short.index_select(0, tok_req)
        counters = _device_counters(device)
        counters[0] += (short > 0).sum()
        counters[1] += ((d_tok < 0) | (d_tok > pad_tok)).sum()
        shift = torch.minimum(d_tok.clamp(min=0), pad_tok)
        dest = torch.tensor(plan.dest, dtype=torch.int64).to(device) - shift
        query = q_latent.new_zeros(plan.rows, num_heads, lrank).index_copy_(0, dest, q_latent[:n_real])
        query_rope = q_rope.new_zeros(plan.rows, num_heads, rdim).index_copy_(0, dest, q_rope[:n_real])
    block_size = kv_cache.shape[1]
    k_nope, k_rope = kv_layout.split_views(kv_cache, lrank, rdim)
    nb = kv_cache.shape[0]
    # Key layout as vllm-ascend passes it: [num_blocks, num_kv_heads=1, block_size, D] (a view: N_kv is 1).
    key = k_nope.view(nb, 1, block_size, lrank)
    key_rope = k_rope.view(nb, 1, block_size, rdim)
    # MLA mode: one query row per pseudo-request takes sparse_mode=0 without a mask, more take sparse_mode=3
    # with the 2048x2048 mask (doc: "Q_S等于1时只支持sparse=0且不传mask，Q_S大于1时只支持sparse=3且传入mask").
    single = all(c + p == 1 for c, p in zip(plan.counts, plan.pads))
    npu = runtime.load()
    attn, _lse = npu.npu_fused_infer_attention_score(
        query,
        key,
        key,
        query_rope=query_rope,
        key_rope=key_rope,
        num_heads=num_heads,
        num_key_value_heads=1,
        input_layout="TND",
        atten_mask=None if single else _causal_mask(device),
        sparse_mode=0 if single else 3,
        scale=softmax_scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=tables.to(torch.int32),
        block_size=block_size,
        actual_seq_lengths=plan.ends,
        actual_seq_lengths_kv=plan.kv_lens,
    )
    out[:n_real] = (attn if dest is None else attn.index_select(0, dest)).to(out.dtype)
    return out


@dataclass
class FiaTask:
    """One captured FIA call: its task-group handle, the ExternalEvent its replay waits on, and the exact call."""

    handle: Any
    event: Any
    args: tuple
    kwargs: dict


def mla_attention_fia_graph(
    graph: Any,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """:func:`mla_attention_fia` inside an NPU decode graph (warm-up and capture; ``graph.py`` explains the layout).

    Same attention and the same ZOS query shift as eager, but every per-step value comes from static device
    buffers: ``seqlens_k`` (ZOS-corrected on the device) and the runner's metadata buffer (each token's FIA row
    before the shift, its graph row, its piece's padding; each row's host key length; each piece's block-table row,
    ``S`` = the appended zero row for dummy pieces). The only host values are FIA's ``actual_seq_lengths(_kv)``:
    the runner re-issues them per step through ``graph_task_update_begin/end``. While capturing, the call is the
    documented ``.out`` form inside its own task group after an ``ExternalEvent`` wait/reset (doc:
    torch_npu-npu-graph_task_group_begin.md; usage: vllm_ascend/attention/mla_v1.py ``_forward_decode``).
    """
    layout, plan = graph.layout, graph.plan
    num_tokens, num_heads, lrank = q_latent.shape
    rdim = q_rope.shape[-1]
    if num_tokens != layout.size:
        raise ValueError(f"graph of size {layout.size} got {num_tokens} query tokens")
    m = graph.views()
    device = q_latent.device
    short = m["k_host"] - seqlens_k.to(torch.int64)  # per graph row: host K - true k (device only)
    d_tok = short.index_select(0, m["token_req"])
    counters = _device_counters(device)
    counters[0] += (short > 0).sum()
    counters[1] += ((d_tok < 0) | (d_tok > m["piece_pad"])).sum()
    dest = m["dest"] - torch.minimum(d_tok.clamp(min=0), m["piece_pad"])
    query = q_latent.new_zeros(layout.rows, num_heads, lrank).index_copy_(0, dest, q_latent)
    query_rope = q_rope.new_zeros(layout.rows, num_heads, rdim).index_copy_(0, dest, q_rope)
    zero_row = block_tables.new_zeros(1, block_tables.shape[1])
    tables = torch.cat((block_tables, zero_row)).index_select(0, m["piece_row"]).to(torch.int32)
    block_size = kv_cache.shape[1]
    k_nope, k_rope = kv_layout.split_views(kv_cache, lrank, rdim)
    nb = kv_cache.shape[0]
    key = k_nope.view(nb, 1, block_size, lrank)
    kwargs = dict(
        query_rope=query_rope,
        key_rope=k_rope.view(nb, 1, block_size, rdim),
        num_heads=num_heads,
        num_key_value_heads=1,
        input_layout="TND",
        atten_mask=None if layout.single_row else _causal_mask(device),
        sparse_mode=0 if layout.single_row else 3,
        scale=softmax_scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=tables,
        block_size=block_size,
        actual_seq_lengths=list(plan.ends),
        actual_seq_lengths_kv=list(plan.kv_lens),
    )
    npu, ns = runtime.load(), runtime.npu_namespace()
    STATS["fia_graph_captured" if ns.is_current_stream_capturing() else "fia_graph_warmup"] += 1
    if ns.is_current_stream_capturing():
        stream = ns.current_stream()
        event = ns.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        if graph.workspace is None:  # one workspace per graph, shared by its (sequential) FIA tasks
            graph.workspace = npu._npu_fused_infer_attention_score_get_max_workspace(query, key, key, **kwargs)
        attn = torch.empty_like(query)
        lse = torch.empty(layout.rows, dtype=query.dtype, device=device)
        args = (query, key, key)
        call = dict(kwargs, workspace=graph.workspace, out=[attn, lse])
        ns.graph_task_group_begin(stream)
        npu.npu_fused_infer_attention_score.out(*args, **call)
        handle = ns.graph_task_group_end(stream)
        graph.tasks.append(FiaTask(handle=handle, event=event, args=args, kwargs=call))
    else:
        attn, _lse = npu.npu_fused_infer_attention_score(query, key, key, **kwargs)
    return attn.index_select(0, dest).to(q_latent.dtype)


def mla_attention_dense(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sync-free MLA attention over the split-layout cache from device lengths only (plain aten ops).

    For calls without host lengths inside the launch path (the MTP drafter's chain builds its metadata on the
    device). Every request's keys are gathered up to the block table's width (a host shape), scored against
    each of its tokens and masked at the token's device position. Memory ``T x nb*block_size x (L + R)``: meant
    for the chain's one-token rows, not for prefill.
    """
    num_tokens, num_heads, lrank = q_latent.shape
    rdim = q_rope.shape[-1]
    b, nb = block_tables.shape
    block_size = kv_cache.shape[1]
    k_nope, k_rope = kv_layout.split_views(kv_cache, lrank, rdim)
    flat_tables = block_tables.to(torch.int64).reshape(-1)
    keys = k_nope.index_select(0, flat_tables).view(b, nb * block_size, lrank)
    ropes = k_rope.index_select(0, flat_tables).view(b, nb * block_size, rdim)
    cu = cu_seqlens_q.to(torch.int64)
    t = torch.arange(num_tokens, device=q_latent.device)
    row = torch.searchsorted(cu[1:].contiguous(), t, right=True).clamp(max=b - 1)
    pos = seqlens_k.to(torch.int64)[row] - seqlens_q.to(torch.int64)[row] + (t - cu[row])
    kr = keys.index_select(0, row).float()  # [T, K, L]
    scores = torch.einsum("thl,tkl->thk", q_latent.float(), kr)
    scores = scores + torch.einsum("thr,tkr->thk", q_rope.float(), ropes.index_select(0, row).float())
    scores = scores * softmax_scale
    k_pos = torch.arange(nb * block_size, device=q_latent.device)
    scores = scores.masked_fill((k_pos[None, :] > pos[:, None])[:, None, :], float("-inf"))
    out = torch.einsum("thk,tkl->thl", torch.softmax(scores, dim=-1), kr)
    valid = (t < cu[-1]).to(out.dtype)[:, None, None]  # tokens past the last request (none today) stay zero
    return (out * valid).to(q_latent.dtype)


def mla_epilogue(out_latent: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``W_UV`` up-projection (aten bmm) then ``o_proj`` — plain matmuls, native on the NPU."""
    values = torch.einsum("thl,hvl->thv", out_latent, w.w_uv)
    return F.linear(values.reshape(values.shape[0], -1), w.o_proj, w.o_bias)
