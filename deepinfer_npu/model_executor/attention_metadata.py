"""AttentionMetadata: the per-step description of which cache rows each query token reads and writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

IntArray = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class HostLengths:
    """Host copies of a step's lengths, for kernels whose API takes host ints (Ascend's fused attention takes
    ``actual_seq_lengths(_kv)`` lists; CUDA kernels pick a compiled variant by the max query length).

    ``seqlens_q`` is exact. ``seqlens_k`` is exact when ``seqlens_k_exact``; under zero-overhead scheduling it is
    the CPU's optimistic value and the exact lengths exist only on the device (``AttentionMetadata``). It is an
    upper bound on backends that do not re-split query lengths on the device (``supports_device_resplit``
    False); after a device re-split a row may have accepted more drafts than the CPU planned.
    """

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    seqlens_k_exact: bool
    max_seqlen_q: int
    max_seqlen_k: int
    max_kv_shortfall: int | None = None  # when not exact: most the true seqlens_k can fall below seqlens_k


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (device tensors except the host ints).

    ``seqlens_q`` / ``seqlens_k`` [B] int32: query tokens this step / context length after this step.
    ``cu_seqlens_q`` [B+1] int32: row offsets of each request's queries. ``block_tables`` [B, nb] int32 (0 =
    padding). ``slot_mapping`` [T] int64: ``block * block_size + offset`` of each query token's cache row
    (negative = padding, not written). ``positions`` [T] int64: ``seqlens_k - seqlens_q + j``.
    """

    seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    is_prefill: bool
    host: HostLengths | None = None  # None when the query lengths were re-split on the device

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seqlens_q.shape[0])


def _as_np(x: IntArray, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.cpu().numpy()
    return np.asarray(x, dtype=dtype)


def build_attention_metadata(
    seqlens_q: IntArray,
    seqlens_k: IntArray,
    block_tables: IntArray,
    block_size: int,
    device: torch.device | str = "cpu",
    is_prefill: bool | None = None,
) -> AttentionMetadata:
    """Host-side construction from lengths and block tables (the worker's path and the tests').

    ``block_tables`` [B, nb] must cover ``ceil(seqlens_k / block_size)`` blocks per request. ``is_prefill``
    defaults to ``max(seqlens_q) > 1`` (callers that verify drafts in decode steps pass it explicitly).
    """
    q = _as_np(seqlens_q, np.int64)
    k = _as_np(seqlens_k, np.int64)
    tables = _as_np(block_tables, np.int64).reshape(len(q), -1)
    if np.any(q > k):
        raise ValueError(f"seqlens_q {q.tolist()} exceeds seqlens_k {k.tolist()}")
    if np.any(-(-k // block_size) > tables.shape[1]):
        raise ValueError(f"block_tables with {tables.shape[1]} columns cannot hold seqlens_k {k.tolist()}")
    cu = np.zeros(len(q) + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    positions = np.concatenate([np.arange(kk - qq, kk) for qq, kk in zip(q, k)]) if len(q) else np.zeros(0)
    positions = positions.astype(np.int64)
    rows = np.repeat(np.arange(len(q)), q)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(a).to(device=device, dtype=dtype)

    return AttentionMetadata(
        seqlens_q=t(q, torch.int32),
        seqlens_k=t(k, torch.int32),
        cu_seqlens_q=t(cu, torch.int32),
        block_tables=t(tables, torch.int32),
        slot_mapping=t(slots, torch.int64),
        positions=t(positions, torch.int64),
        max_seqlen_q=int(q.max()) if len(q) else 0,
        max_seqlen_k=int(k.max()) if len(k) else 0,
        is_prefill=bool(q.max() > 1) if is_prefill is None and len(q) else bool(is_prefill),
        host=HostLengths(tuple(int(x) for x in q), tuple(int(x) for x in k), True,
                         int(q.max()) if len(q) else 0, int(k.max()) if len(k) else 0),
    )
